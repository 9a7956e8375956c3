"""What both reducers share: the outcome types, the Reducer protocol and the parameter layout.

Where it sits: below reduce.py (the public face and `make_reducer`), reduce_exact.py and
reduce_fast.py, which all import from here; this module imports none of them, so there is
no import cycle. reduce.py re-exports the public names; import them from there.

`ParamLayout` validates the parameters once at construction (dtype, device, count), checks
every micro-batch's gradients and the all-reduced buffer against them, and writes the
averaged gradients into `.grad` the way plain PyTorch would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch

from keepstep.elastic import reduce_kernels
from keepstep.elastic.errors import ConfigError, StateShapeError

MAX_N_MICRO = 2**24
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class ReduceMode(StrEnum):
    EXACT = "exact"
    FAST = "fast"


@dataclass(frozen=True)
class ReduceDone:
    """The averaged gradients are in `.grad`; the step may be applied."""


@dataclass(frozen=True)
class ReduceOverflow:
    """Some micro-batches exceeded the fixed-point range: retry with `set_retry_exponents`."""

    micro_batches: int

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches={self.micro_batches!r} must be >= 1")


@dataclass(frozen=True)
class ReduceNonFinite:
    """Some micro-batch had inf/nan gradients; rescaling cannot help."""

    reason: str

    def __post_init__(self) -> None:
        if not self.reason:
            raise ConfigError("ReduceNonFinite needs a non-empty reason")


ReduceOutcome = ReduceDone | ReduceOverflow | ReduceNonFinite


@dataclass(frozen=True)
class Settled:
    """A step whose sum is good (the exact reducer's ``settle``): per tensor, the divisor
    that turns its summed integers into the averaged gradient, and how many micro-batches
    gave it one (0: its ``.grad`` stays None)."""

    divisors: tuple[float, ...]
    given: tuple[int, ...]


class Reducer(Protocol):
    mode: ReduceMode

    def begin_step(self) -> None: ...
    def add_micro_batch(self, grads: Sequence[torch.Tensor | None]) -> None: ...
    def buffer(self) -> torch.Tensor:
        """The step's sum, to be all-reduced (SUM) in place and handed to `finish`.

        Its last `caller_slots` elements are the caller's: `begin_step` zeroes them, the
        all-reduce sums them with the rest, and the reducer never reads them. `Step` puts
        each member's compute seconds and the planned-change flag there (step.py), so
        that news needs no collective of its own.
        """
        ...

    def set_caller_slots(self, count: int) -> None:
        """Make the buffer's last `count` (>= 1; 1 until set) elements the caller's, from
        the next `begin_step` on; a new count takes a fresh buffer."""
        ...

    def abandon_buffer(self) -> None:
        """Take a fresh buffer: the current one went to a collective that was given up.

        A given-up gloo group lives on until its work ends (comm/), and if the peer it
        waited for comes back (a node resumed after a stop) the work completes and writes
        into the tensor it was handed. Reusing that tensor would let a dead epoch's bytes
        land in a later step's sum; the old one is left to the dead group.
        """
        ...

    def finish(
        self,
        reduced: torch.Tensor,
        n_micro: int,
        params: Sequence[torch.Tensor],
        total_weight: int | None = None,
    ) -> ReduceOutcome: ...
    def retry_max_buffer(self) -> torch.Tensor: ...
    def set_retry_exponents(self, reduced_max: torch.Tensor) -> None: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...


def check_total_weight(total: object) -> int:
    """A weighted mean's divisor: the step's summed micro-batch weights, an int in
    [1, 2**53) (so it and its multiples by the exact mode's powers of two are exact)."""
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total < 2**53:
        raise ConfigError(
            f"the micro-batches' weights sum to {total!r}: a weighted mean needs a total in "
            "[1, 2**53) (every micro-batch of the step had weight 0?)"
        )
    return total


def check_caller_slots(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"caller_slots={count!r} must be an int >= 1")
    return count


def check_exact_state(
    state: Mapping[str, torch.Tensor], n_t: int, limit_bits: int
) -> tuple[list[int], list[float]]:
    """The exponents and peaks of an `ExactReducer.state_dict()`, checked against a reducer
    of `n_t` tensors and `limit_bits` (StateShapeError naming what differs)."""
    expect = {
        "exponents": (torch.int64, (n_t,)),
        "peak": (torch.float64, (n_t,)),
        "limit_bits": (torch.int64, ()),
    }
    if set(state) != set(expect):
        raise StateShapeError(f"reducer state keys {sorted(state)}; expected {sorted(expect)}")
    for key, (dtype, shape) in expect.items():
        t = state[key]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise StateShapeError(
                f"reducer state {key!r} is {t.dtype} {tuple(t.shape)}; expected {dtype} {shape}"
            )
    if int(state["limit_bits"]) != limit_bits:
        raise StateShapeError(
            f"reducer state has limit_bits={int(state['limit_bits'])}, this job "
            f"{limit_bits} (n_micro changed?)"
        )
    ks = [int(k) for k in state["exponents"].tolist()]
    return ks, [float(p) for p in state["peak"].tolist()]


def abs_max(tensors: Sequence[torch.Tensor], fused: bool) -> torch.Tensor:
    """Per-tensor max |x| as one float64 vector; exact, and nan/inf propagate."""
    if not fused:
        # vector_norm(inf) is not vectorised on CPU; aminmax is several times faster.
        pairs = [torch.aminmax(t) for t in tensors]
        lo = torch.stack([p.min for p in pairs])  # stack promotes mixed dtypes exactly
        hi = torch.stack([p.max for p in pairs])
        return torch.maximum(hi, -lo).to(torch.float64)
    return torch.stack(torch._foreach_norm(list(tensors), ord=math.inf)).to(torch.float64)


def nonfinite_reason(what: str, bad: Sequence[bool]) -> str:
    index = [i for i, b in enumerate(bad) if b]
    shown = ", ".join(str(i) for i in index[:8]) + (", ..." if len(index) > 8 else "")
    return f"{what} inf/nan gradients (param indices {shown})"


class ParamLayout:
    """Validated parameter specs and the checks and helpers both modes share."""

    def __init__(self, params: Sequence[torch.Tensor], n_micro: int) -> None:
        if isinstance(n_micro, bool) or not isinstance(n_micro, int):
            raise ConfigError(f"n_micro={n_micro!r} must be an int")
        if not 1 <= n_micro <= MAX_N_MICRO:
            raise ConfigError(f"n_micro={n_micro} must be in [1, {MAX_N_MICRO}]")
        if isinstance(params, torch.Tensor) or len(params) == 0:
            raise ConfigError("params must be a non-empty sequence of tensors")
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise ConfigError(f"params[{i}] is a {type(p).__name__}, not a torch.Tensor")
            if p.dtype not in _DTYPES:
                raise ConfigError(f"params[{i}] has dtype {p.dtype}; allowed: {_DTYPES}")
            if p.device != params[0].device:
                raise ConfigError(f"params[{i}] is on {p.device}, params[0] on {params[0].device}")
        self.n_micro = n_micro
        self.device = params[0].device
        self.specs = [(p.shape, p.dtype) for p in params]
        self.numels = [p.numel() for p in params]
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def present(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[int, torch.Tensor]]:
        """The given gradients with their indices, checked against the params."""
        if len(grads) != len(self.specs):
            raise StateShapeError(f"got {len(grads)} gradients for {len(self.specs)} params")
        out = []
        for i, g in enumerate(grads):
            if g is not None:
                if (g.shape, g.dtype) != self.specs[i] or g.device != self.device:
                    shape, dtype = self.specs[i]
                    raise StateShapeError(
                        f"gradient {i} is {g.dtype} {tuple(g.shape)} on {g.device}; "
                        f"the param is {dtype} {tuple(shape)} on {self.device}"
                    )
                out.append((i, g))
        return out

    def mask(self, given: Sequence[tuple[int, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
        """1 for each param given a gradient; cached, so no host-to-device copy per call."""
        key = tuple(i for i, _ in given)
        if key not in self._masks:
            flags = [0] * len(self.specs)
            for i in key:
                flags[i] = 1
            self._masks[key] = torch.tensor(flags, dtype=dtype, device=self.device)
        return self._masks[key]

    def check_finish(
        self,
        reduced: torch.Tensor,
        like: torch.Tensor,
        n_micro: int,
        params: Sequence[torch.Tensor],
    ) -> None:
        if n_micro != self.n_micro:
            raise ConfigError(f"n_micro={n_micro!r} differs from the reducer's {self.n_micro}")
        if reduced.dtype != like.dtype or reduced.shape != like.shape:
            raise StateShapeError(
                f"reduced buffer is {reduced.dtype} {tuple(reduced.shape)}; "
                f"expected {like.dtype} {tuple(like.shape)}"
            )
        if [(p.shape, p.dtype) for p in params] != self.specs:
            raise StateShapeError("params differ in number, shape or dtype from construction")

    def set_grads(
        self, params: Sequence[torch.Tensor], values: Sequence[torch.Tensor], given: Sequence[int]
    ) -> None:
        """New `.grad` tensors; None where no micro-batch gave one, as in plain PyTorch."""
        live = [i for i, n in enumerate(given) if n > 0]
        grads = [torch.empty_like(params[i]) for i in live]
        if live:
            torch._foreach_copy_(grads, [values[i] for i in live])
        for p in params:
            p.grad = None
        for i, g in zip(live, grads, strict=True):
            params[i].grad = g


def check_exact_paths(
    device: torch.device, device_ops: object, kernels: bool | None, compile: bool | None
) -> None:
    if device_ops is not None and not isinstance(device_ops, bool):
        raise ConfigError(f"device_ops={device_ops!r} must be a bool or None")
    use_dev = device.type != "cpu" if device_ops is None else device_ops
    if (use_dev and kernels) or (compile is not None and not use_dev):
        raise ConfigError(
            f"device_ops={device_ops!r} with kernels={kernels!r}, compile={compile!r}: "
            "kernels need device_ops off; compile needs it on"
        )
    if kernels and not (device.type == "cpu" and reduce_kernels.available()):
        raise ConfigError(
            f"kernels=True needs CPU parameters (these are on {device}) and the "
            "numba package (pip install numba)"
        )


def check_exact_range(
    limit_bits: int, n_micro: int, headroom_bits: object, initial_max: object
) -> None:
    if isinstance(headroom_bits, bool) or not isinstance(headroom_bits, int):
        raise ConfigError(f"headroom_bits={headroom_bits!r} must be an int")
    if not 0 <= headroom_bits <= limit_bits - 24:
        raise ConfigError(
            f"headroom_bits={headroom_bits} must be in [0, {limit_bits - 24}] so that "
            f"{limit_bits}-bit fixed point (n_micro={n_micro}) keeps >= 24 bits"
        )
    if not isinstance(initial_max, int | float) or not 0 < initial_max < math.inf:
        raise ConfigError(f"initial_max={initial_max!r} must be a finite number > 0")
