"""FAST mode: float32 accumulation and all-reduce, the way DDP sums gradients.

Where it sits: `make_reducer` (reduce.py) builds a `FastReducer` for `ReduceMode.FAST`;
`Step` drives it through the `Reducer` protocol (reduce_base.py), exactly as it drives the
EXACT reducer (reduce_exact.py), minus the overflow retry, which fast mode never asks for.

Gradients are accumulated in float32 (whatever the parameter dtype), the buffer is
all-reduced with a float32 SUM and divided by n_micro; the buffer's tail counts, per
tensor, the micro-batches that gave a gradient, then come the caller's slots (see
`Reducer.buffer`). It is not order-invariant; tests measure its deviation from EXACT mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from keepstep.elastic.errors import KeepstepError, StateShapeError
from keepstep.elastic.reduce_base import (
    ParamLayout,
    ReduceDone,
    ReduceMode,
    ReduceNonFinite,
    ReduceOutcome,
    abs_max,
    check_caller_slots,
    check_total_weight,
    nonfinite_reason,
)


class FastReducer:
    """float32 accumulation and all-reduce, like DDP: fast, not order-invariant."""

    def __init__(self, params: Sequence[torch.Tensor], n_micro: int) -> None:
        self.mode = ReduceMode.FAST
        self._layout = layout = ParamLayout(params, n_micro)
        self._n = sum(layout.numels)
        self._end = self._n + len(layout.specs)  # where the caller's slots begin
        self._out = self._acc = torch.empty(0)
        self._oviews: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self.set_caller_slots(1)

    def set_caller_slots(self, count: int) -> None:
        # Tail: micro-batches that gave each tensor a gradient, then the caller's slots.
        size = self._end + check_caller_slots(count)
        if self._out.numel() != size:
            self._out = torch.empty(size, device=self._layout.device)
            self._oviews = self._split(self._out)
            self.abandon_buffer()

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, at = [], 0
        for (shape, _), numel in zip(self._layout.specs, self._layout.numels, strict=True):
            views.append(flat[at : at + numel].view(shape))
            at += numel
        return views

    def abandon_buffer(self) -> None:
        self._acc = torch.zeros_like(self._out)
        self._views = self._split(self._acc)

    def begin_step(self) -> None:
        self._acc.zero_()

    def add_micro_batch(self, grads: Sequence[torch.Tensor | None]) -> None:
        given = self._layout.present(grads)
        if given:
            torch._foreach_add_([self._views[i] for i, _ in given], [g for _, g in given])
        self._acc[self._n : self._end].add_(self._layout.mask(given, torch.float32))

    def buffer(self) -> torch.Tensor:
        return self._acc

    def finish(
        self,
        reduced: torch.Tensor,
        n_micro: int,
        params: Sequence[torch.Tensor],
        total_weight: int | None = None,
    ) -> ReduceOutcome:
        self._layout.check_finish(reduced, self._acc, n_micro, params)
        n = n_micro if total_weight is None else check_total_weight(total_weight)
        torch.div(reduced, n, out=self._out)
        live = [v for v in self._oviews if v.numel()]
        peaks = abs_max(live, self._acc.device.type != "cpu") if live else self._acc[:0]
        finite = iter(torch.isfinite(peaks).tolist())
        bad = [bool(v.numel()) and not next(finite) for v in self._oviews]
        if any(bad):
            return ReduceNonFinite(nonfinite_reason("the reduced sum has", bad))
        self._layout.set_grads(params, self._oviews, reduced[self._n : self._end].tolist())
        return ReduceDone()

    def retry_max_buffer(self) -> torch.Tensor:
        raise KeepstepError("retry_max_buffer: fast mode never overflows; only exact mode retries")

    def set_retry_exponents(self, reduced_max: torch.Tensor) -> None:
        raise KeepstepError("set_retry_exponents: fast mode has no exponents")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise StateShapeError(f"fast reducer has no state; got keys {sorted(state)}")
