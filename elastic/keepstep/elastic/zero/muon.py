"""Muon under ZeRO: the momentum sharded like any elementwise state, each matrix
orthogonalised and stepped whole by one rank.

Where it sits: ``rebuild`` (zero/optimizers.py) builds a ``MuonWindows`` where the script
has ``torch.optim.Muon``, over the 1-D windows a rank steps (zero/ownership.py).
``torch.optim.Muon`` steps each matrix P with gradient G as

    B <- lerp(B, G, 1 - mu)                      elementwise
    U <- lerp(G, B, mu) if nesterov else B       elementwise
    O <- NewtonSchulz(U)                         the whole matrix
    P <- P * (1 - lr * wd) - lr' * O             elementwise (lr' scaled by P's shape)

The first two lines run on the windows, as every elementwise optimizer does under ZeRO:
the momentum ``B`` stays sharded, about 1/W of it per rank. The third needs ``U`` whole,
so ``MuonWindows.step`` hands the windows' ``U`` to a *finisher*. ``ZeroOptimizer``'s
(zero/matrices.py) gives every matrix to one rank (``designate``: the Newton-Schulz work
balanced across the ranks, largest matrices first), sends it the owners' pieces of ``U``
(an all-to-all), and each rank steps its matrices whole with ``step_matrix``: torch's own
Newton-Schulz function on the same matrix, then the same elementwise calls on the same
shape. Same kernels, same input: the same bits as the unsharded step. The parameter
all-gather that follows sends each matrix whole from the rank that stepped it. So each
matrix is orthogonalised once in the job, not once per member, and no rank holds more
than its own matrices' ``U`` whole.

Without a finisher (a replica's step, zero/replicas.py, keeps the state only) the step
stops after the momentum.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.zero.pieces import assign_whole

__all__ = [
    "MUON",
    "Finish",
    "MuonWindows",
    "check_muon",
    "designate",
    "ns_cost",
    "scales_its_input",
    "step_matrix",
]

# The script's class, where this torch has one (torch >= 2.9).
MUON: type[torch.optim.Optimizer] | None = getattr(torch.optim, "Muon", None)

# The windows' updates U (1-D, by window view), to be orthogonalised and applied.
Finish = Callable[[Mapping[torch.Tensor, torch.Tensor]], None]


class MuonWindows(torch.optim.Optimizer):
    """``torch.optim.Muon``'s momentum over 1-D windows; ``finish`` (if any) gets the
    windows' updates at the end of every step, to orthogonalise and apply them."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        defaults: Mapping[str, Any],
        finish: Finish | None = None,
    ) -> None:
        super().__init__(list(params), dict(defaults))
        self.finish = finish

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("Muon under ZeRO steps without a closure")
        updates: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            momentum = group["momentum"]
            for view in group["params"]:
                grad = view.grad
                if grad is None:  # torch's Muon leaves such a matrix alone
                    continue
                state = self.state[view]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - momentum)
                updates[view] = grad.lerp(buf, momentum) if group["nesterov"] else buf
        if self.finish is not None:
            self.finish(updates)


def ns_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix of ``shape`` (m <= n after
    the transpose): the Gram matrix (m*m*n), its square (m^3), the update (m*m*n)."""
    m, n = sorted(shape)
    return 2 * m * m * n + m * m * m


def designate(
    shapes: Mapping[int, Sequence[int]], world: int, speeds: Sequence[float] | None = None
) -> dict[int, int]:
    """The rank that steps each matrix whole, by tensor index: the Newton-Schulz work
    balanced over the ranks' ``speeds`` (``assign_whole`` of ``ns_cost``), the same on
    every rank."""
    return assign_whole({t: ns_cost(s) for t, s in shapes.items()}, world, speeds)


def step_matrix(param: torch.Tensor, update: torch.Tensor, group: Mapping[str, Any]) -> None:
    """One Muon step of the whole matrix ``param`` (detached) with its momentum update
    ``update`` (its shape), as ``torch.optim.Muon`` makes it: the same functions, in the
    same order, on the same shapes."""
    from torch.optim import _muon  # torch's own functions: the same bits as its step
    from torch.optim.optimizer import _to_scalar

    lr = _to_scalar(group["lr"])
    ortho = _muon._zeropower_via_newtonschulz(
        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
    )
    adjusted = _muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape)
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-adjusted)


def check_muon(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what the sharded step would not reproduce: a parameter that is not a matrix
    (torch refuses it at construction, a script may have added one since), a torch
    without the functions ``step_matrix`` calls, and plain momentum on bfloat16 matrices
    where torch's own step rescales the momentum (``scales_its_input``)."""
    try:
        from torch.optim import _muon

        _muon._zeropower_via_newtonschulz, _muon._adjust_lr  # noqa: B018
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"ZeRO cannot shard Muon on torch {torch.__version__}: its Newton-Schulz "
            f"function is not where keepstep calls it ({err})"
        ) from None
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.ndim != 2:
                raise ConfigError(
                    f"Muon param group {gi} holds a tensor of shape {tuple(p.shape)}: Muon "
                    "steps 2-D matrices only"
                )
        low = any(p.dtype == torch.bfloat16 for p in group["params"])
        if low and not group["nesterov"] and scales_its_input(_muon._zeropower_via_newtonschulz):
            raise ConfigError(
                f"ZeRO cannot shard Muon param group {gi} (bfloat16 matrices, nesterov=False) "
                f"on torch {torch.__version__}: its Newton-Schulz function scales a bfloat16 "
                "input in place, so its own step rescales the momentum buffer every step, "
                "which the sharded step would not repeat (later torch copies the input). "
                "Use nesterov=True, float32 matrices or a newer torch, or leave out shard="
            )


@functools.cache
def scales_its_input(newton_schulz: Callable[..., torch.Tensor]) -> bool:
    """Whether ``newton_schulz`` (torch's) writes into a bfloat16 input it is given, as
    torch's did before it copied the input: its Muon step passes the momentum buffer
    itself when not nesterov, so that step also rescales the momentum."""
    probe = torch.full((2, 2), 2.0, dtype=torch.bfloat16)
    newton_schulz(probe, (3.4445, -4.7750, 2.0315), 1, 1e-7)
    return not bool((probe == 2.0).all())
