"""Simulated ranks for the reducer's tests (test_reduce.py, test_reduce_callers.py): each
rank is a Reducer fed its micro-batches, and the all-reduce is an explicit sum of their
buffers in a chosen order (the exact reducer's buffers hold integers that float64 adds
exactly, so only the reducer can make the results differ). Gradients are a pure function
of (step, micro-batch), over tensors of every float dtype and magnitudes 1e-8..1e3."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from keepstep.elastic.reduce import (
    ExactReducer,
    ReduceMode,
    ReduceOutcome,
    Reducer,
    make_reducer,
)

N_MICRO = 12
# (shape, dtype, magnitude): magnitudes span 1e-8..1e3; an empty tensor; a tensor never
# given a gradient (index 5); index 3 gets None on every third micro-batch.
SPEC: list[tuple[tuple[int, ...], torch.dtype, float]] = [
    ((7, 5), torch.float32, 1e-8),
    ((13,), torch.float64, 1e3),
    ((3, 4, 2), torch.bfloat16, 1e-4),
    ((6,), torch.float16, 10.0),
    ((0,), torch.float32, 1.0),
    ((5,), torch.float32, 1.0),
]
BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
PATHS: list[dict[str, bool]] = [{"kernels": True}, {"kernels": False}, {"device_ops": True}]
Grads = list[torch.Tensor | None]
Poison = Callable[[int, int, Grads], None]


def make_params() -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype) for shape, dtype, _ in SPEC]


def grads_for(step: int, mb: int, poison: Poison | None = None) -> Grads:
    """The gradient of micro-batch `mb` of `step`: a pure function of (step, mb)."""
    gen = torch.Generator().manual_seed(1000 * step + mb)
    out: Grads = []
    for i, (shape, dtype, mag) in enumerate(SPEC):
        if i == 5 or (i == 3 and mb % 3 == 0):
            out.append(None)
            continue
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        # Within a tensor, elements also spread over three decades.
        x *= 10.0 ** (-3.0 * torch.rand(shape, generator=gen, dtype=torch.float64)) * mag
        out.append(x.to(dtype))
    if poison is not None:
        poison(step, mb, out)
    return out


def reference(
    step: int, poison: Poison | None = None, absolute: bool = False
) -> list[torch.Tensor]:
    """The float64 mean over micro-batches (of |g| with `absolute`, for error bounds)."""
    total = [torch.zeros(shape, dtype=torch.float64) for shape, _, _ in SPEC]
    for mb in range(N_MICRO):
        for t, g in zip(total, grads_for(step, mb, poison), strict=True):
            if g is not None:
                t += g.double().abs() if absolute else g.double()
    return [t / N_MICRO for t in total]


def groupings() -> list[list[list[int]]]:
    ids = list(range(N_MICRO))
    shuffled = random.Random(7).sample(ids, N_MICRO)
    out = [[ids], [[], ids], [[0], ids[1:]]]  # one rank; an idle rank; a lopsided pair
    for r in (2, 3, 4):
        out.append([ids[i::r] for i in range(r)])
        out.append([ids[i * N_MICRO // r : (i + 1) * N_MICRO // r] for i in range(r)])
        out.append([shuffled[i::r] for i in range(r)])
    return out


def combine(buffers: list[torch.Tensor], how: int) -> torch.Tensor:
    """Sum in one of several orders: forward, reverse, pairwise tree, rotated."""
    bufs = [b.clone() for b in buffers]
    if how % 4 == 1:
        bufs.reverse()
    elif how % 4 == 2:
        while len(bufs) > 1:
            bufs = [
                bufs[i] + bufs[i + 1] if i + 1 < len(bufs) else bufs[i]
                for i in range(0, len(bufs), 2)
            ]
        return bufs[0]
    elif how % 4 == 3:
        bufs = bufs[1:] + bufs[:1]
    total = bufs[0]
    for b in bufs[1:]:
        total = total + b
    return total


class Ranks:
    """One simulated job: a reducer and a parameter copy per rank."""

    def __init__(
        self, grouping: list[list[int]], how: int, mode: ReduceMode = ReduceMode.EXACT
    ) -> None:
        self.grouping = grouping
        self.how = how
        self.params = [make_params() for _ in grouping]
        # Exact mode: the ranks take turns over the three paths (the numba kernels, the
        # tensor ops, the device path run on the CPU), so every multi-rank case also
        # checks that they give the same bits.
        self.reducers = [
            ExactReducer(p, N_MICRO, **PATHS[r % len(PATHS)])
            if mode is ReduceMode.EXACT
            else make_reducer(mode, p, N_MICRO)
            for r, p in enumerate(self.params)
        ]

    def step(self, step: int, poison: Poison | None = None) -> list[ReduceOutcome]:
        for r, (reducer, ids) in enumerate(zip(self.reducers, self.grouping, strict=True)):
            reducer.begin_step()
            # The order within a rank must not matter either.
            for mb in random.Random(step * 31 + r).sample(ids, len(ids)):
                reducer.add_micro_batch(grads_for(step, mb, poison))
        reduced = combine([rd.buffer() for rd in self.reducers], self.how)
        return [
            rd.finish(reduced.clone(), N_MICRO, p)
            for rd, p in zip(self.reducers, self.params, strict=True)
        ]

    def retry_exponents(self) -> None:
        peaks = [rd.retry_max_buffer() for rd in self.reducers]
        order = peaks[::-1] if self.how % 2 else peaks
        agreed = order[0]
        for p in order[1:]:
            agreed = torch.maximum(agreed, p)
        for rd in self.reducers:
            rd.set_retry_exponents(agreed.clone())

    def grads(self) -> list[torch.Tensor | None]:
        """Rank 0's averaged gradients, after checking every rank has the same bits."""
        first = [p.grad for p in self.params[0]]
        for params in self.params[1:]:
            assert_same_bits(first, [p.grad for p in params])
        # Param 5 never gets a gradient: it keeps None, as in plain PyTorch.
        assert [g is None for g in first] == [i == 5 for i in range(len(SPEC))]
        return first


def assert_same_bits(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"tensor {i}: gradient on one side only"
            continue
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(BITS[x.dtype]), y.view(BITS[y.dtype])), f"tensor {i} differs"


def exact(reducer: Reducer) -> ExactReducer:
    assert isinstance(reducer, ExactReducer)
    return reducer
