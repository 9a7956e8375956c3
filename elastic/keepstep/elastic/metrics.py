"""`step.log(loss=...)`: scalars reduced across members to the same value at any world size.

Where it sits: `Step.log` records one value per (name, micro-batch) of this member; at
commit, after the gradient's reduction and before the optimizer step, `Step` sums one
float64 buffer over the epoch's communicator and `StepMetrics.reduce` turns it into one
value per name. The result is in the `CommitResult` (for the script), in the commit record
(for the agent's event log, the run summary, the dashboard and telemetry).

Why the value does not depend on the world size: each slot of the buffer belongs to one
micro-batch, and exactly one member computes a micro-batch, so the all-reduce adds a value
to zeros only, which is exact in any order. Every member then averages the slots in
micro-batch order: the same float operations whatever the membership. A second set of
slots counts who logged, so a name that some micro-batch did not log (a script that logs on
one rank only) is refused with the same error on every member instead of averaging a part.

In a job with a weighted mean (weights.py) the average is weighted as the gradient is: a
third set of slots holds each micro-batch's weight, and a name's value is the sum of
weight x value over the summed weights, so a per-micro-batch mean logged as ``loss_sum /
n`` gives the global batch's mean per token. A micro-batch of weight 0 counts for nothing
(its logged 0/0 is not read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from keepstep.elastic.errors import ConfigError


class StepMetrics:
    """One step's logged values on this member, by name and micro-batch."""

    def __init__(self, names: Sequence[str], n_micro: int, weighted: bool = False) -> None:
        self.names = tuple(names)
        self.n_micro = n_micro
        self.weighted = weighted
        self._values: dict[tuple[int, int], float] = {}  # (name index, mb id) -> value
        self.weights: dict[int, int] = {}  # mb id -> its weight (a weighted job's)

    def log(self, mb_id: int, values: Mapping[str, object]) -> None:
        """Record `values` for micro-batch `mb_id` (a later call for it replaces a name)."""
        for name, value in values.items():
            if name not in self.names:
                declared = ", ".join(repr(n) for n in self.names) or "none"
                raise ConfigError(
                    f"step.log({name}=...): {name!r} is not a declared metric (declared: "
                    f"{declared}); pass metrics=({name!r}, ...) to keepstep.init"
                )
            self._values[(self.names.index(name), mb_id)] = _scalar(name, value)

    def buffer(self, device: torch.device | None = None) -> torch.Tensor:
        """Values then presence, one float64 slot per (name, micro-batch), then (weighted)
        one weight per micro-batch; zeros elsewhere. Filled on the CPU, then moved to
        ``device`` (the communicator's: NCCL reduces only device tensors)."""
        k, n = len(self.names), self.n_micro
        out = torch.zeros(2 * k * n + (n if self.weighted else 0), dtype=torch.float64)
        for (i, mb), value in self._values.items():
            out[i * n + mb] = value
            out[k * n + i * n + mb] = 1.0
        for mb, weight in self.weights.items():
            out[2 * k * n + mb] = weight  # exact: a count < 2**53 (weights.py)
        return out if device is None else out.to(device)

    def reduce(self, summed: torch.Tensor, step: int) -> dict[str, float]:
        """Each name's mean over the step's micro-batches, from the all-reduced buffer."""
        k, n = len(self.names), self.n_micro
        values, present = summed[: k * n].tolist(), summed[k * n : 2 * k * n].tolist()
        weights = summed[2 * k * n :].tolist() if self.weighted else [1.0] * n
        out: dict[str, float] = {}
        for i, name in enumerate(self.names):
            counts = present[i * n : (i + 1) * n]
            missing = [mb for mb, c in enumerate(counts) if c != 1.0]
            if missing and len(missing) < n:
                raise ConfigError(
                    f"step {step}: metric {name!r} was logged for {n - len(missing)} of {n} "
                    f"micro-batches (not {missing[:8]}); call step.log({name}=...) in every "
                    "micro-batch on every member, or in none"
                )
            if missing:
                continue  # not logged in this step at all
            total = 0.0
            for v, w in zip(values[i * n : (i + 1) * n], weights, strict=True):
                if w:  # in micro-batch order, on every member; weight 0 counts for nothing
                    total += w * v  # 1.0 * v is v: unweighted, the plain mean
            out[name] = total / sum(weights)
        return out


def _scalar(name: str, value: object) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"step.log({name}=...): a tensor of shape {tuple(value.shape)}; log a scalar"
            )
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"step.log({name}={value!r}): expected a number or a 1-element tensor")
    return float(value)
