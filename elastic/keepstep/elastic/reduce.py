"""Order-invariant gradient reduction: the step's sum over micro-batches, bit-identical for
any grouping of micro-batches onto ranks and any order of combining their partial sums.

Where it sits: `Step.backward` calls `add_micro_batch` after each micro-batch's backward;
`Step.commit` all-reduces `buffer()` with SUM, then `finish` writes the averaged gradient
(sum over all `n_micro` micro-batches / `n_micro`, or / the micro-batches' summed weights
for a weighted mean: weights.py) into each parameter's `.grad`.

`finish` returns a ReduceOutcome: ReduceDone (apply the step), ReduceOverflow (EXACT mode
only: all-reduce MAX of `retry_max_buffer()`, call `set_retry_exponents` and recompute the
step) or ReduceNonFinite (inf/nan gradients; rescaling cannot help). Each decision depends
only on the set of micro-batch gradients, never on who computed them.

This module is the public face: `make_reducer` picks the implementation, and the names
below are re-exported from where they live, so callers import from here only:

    reduce_base.py   ReduceMode, the outcomes, the Reducer protocol, MAX_N_MICRO, and the
                     parameter checks both modes share
    reduce_exact.py  ExactReducer: fixed-point integer sums, order-invariant (the default)
    reduce_kernels.py  its fused one-pass CPU loops (numba), same bits as its tensor ops
    reduce_fast.py   FastReducer: float32 sums like DDP, not order-invariant
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.reduce_base import (
    MAX_N_MICRO,
    ReduceDone,
    ReduceMode,
    ReduceNonFinite,
    ReduceOutcome,
    ReduceOverflow,
    Reducer,
)
from keepstep.elastic.reduce_exact import ExactReducer
from keepstep.elastic.reduce_fast import FastReducer

__all__ = [
    "MAX_N_MICRO",
    "ExactReducer",
    "FastReducer",
    "ReduceDone",
    "ReduceMode",
    "ReduceNonFinite",
    "ReduceOutcome",
    "ReduceOverflow",
    "Reducer",
    "make_reducer",
]


def make_reducer(
    mode: ReduceMode,
    params: Sequence[torch.Tensor],
    n_micro: int,
    headroom_bits: int = 8,
    initial_max: float = 2.0**16,
) -> Reducer:
    """The reducer for `mode` over `params` (shapes and dtypes fixed for the job)."""
    try:
        mode = ReduceMode(mode)
    except ValueError:
        allowed = ", ".join(m.value for m in ReduceMode)
        raise ConfigError(f"mode={mode!r} is not a reduce mode; allowed: {allowed}") from None
    if mode is ReduceMode.EXACT:
        return ExactReducer(params, n_micro, headroom_bits, initial_max)
    return FastReducer(params, n_micro)
