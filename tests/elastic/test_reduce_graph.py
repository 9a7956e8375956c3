"""Tests of keepstep.elastic.reduce_graph through the reducer: a micro-batch that gives every
gradient is one compiled call (Inductor's CPU code standing in for its CUDA code), with the
bits of the eager device ops, the numba kernels and the tensor ops, through ties,
subnormals, signed zeros, an overflow and its retry, and non-finite values; absent
gradients go in the same call as zeros; no step compiles; a guard that fails anyway runs
the same body eager.

Every test uses the same tensors, so the graph compiles once per process (seconds on a CPU).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from test_reduce_device import SPECIAL, Case, Grads, assert_same_run, paths, run, same_bits
from torch._dynamo.utils import counters

from keepstep.elastic.reduce import ExactReducer, ReduceDone, ReduceNonFinite, ReduceOverflow
from keepstep.elastic.reduce_device import AddPath

# A transposed float32 matrix, bfloat16, float64, a one-element float16, an empty tensor.
SPEC = [
    ((5, 7), torch.float32, True),
    ((33,), torch.bfloat16, False),
    ((9,), torch.float64, False),
    ((1,), torch.float16, False),
    ((0,), torch.float32, False),
    ((2, 3), torch.float16, False),
]
N_MICRO = 3
N_DATA = sum(math.prod(s) for s, _, _ in SPEC)
COMPILED = {"device_ops": True, "compile": True}


def grads(seed: int, scale: float, special: float | None = None, skip: int = -1) -> Grads:
    """One micro-batch: gradients of about `scale`, a rounding tie first, `special` last,
    tensor `skip` absent; the transposed matrix's gradient in its parameter's layout."""
    gen = torch.Generator().manual_seed(seed)
    out: Grads = []
    for t, (shape, dtype, transposed) in enumerate(SPEC):
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        flat = x.view(-1)
        if flat.numel():
            flat[0] = 2.5 * 2.0**-35  # a tie at the first step's k = 35 (3 micro-batches)
        if flat.numel() > 1 and special is not None:
            flat[-1] = special
        g = x.to(dtype)
        out.append(None if t == skip else g.t().contiguous().t() if transposed else g)
    return out


def check_every_path(case: Case) -> list[AddPath | None]:
    """The compiled path's run equals every other path's, bit for bit; returns how the
    compiled path added each micro-batch."""
    compiled = run(case, COMPILED)
    for path in paths():
        assert_same_run(compiled, run(case, path), N_DATA)
    return compiled.added


def test_a_micro_batch_with_every_gradient_is_one_compiled_call() -> None:
    """Three steps: ties, subnormals and signed zeros; an overflow and its retry; then
    non-finite values. Every micro-batch one call of the graph, the bits of every path."""
    steps = [
        [grads(1, 2.0**-5, -0.0), grads(2, 2.0**-130, 1e-40), grads(3, 1.0, -1e-45)],
        [grads(4, 1.0), grads(5, 2.0**10), grads(6, 2.0**-3, 6e-8)],
        [grads(7 + mb, 2.0**mb, SPECIAL[7 + mb]) for mb in range(N_MICRO)],
    ]
    case = Case(SPEC, N_MICRO, steps)
    added = check_every_path(case)
    assert added == [AddPath.GRAPH] * 12  # 3 micro-batches, 4 attempts: not vacuous
    outcomes = run(case, {"kernels": False}).outcomes
    assert outcomes[:3] == [ReduceDone(), ReduceOverflow(micro_batches=1), ReduceDone()]
    assert isinstance(outcomes[3], ReduceNonFinite)


def test_absent_gradients_go_in_the_same_call_as_zeros() -> None:
    """A micro-batch that leaves tensors out (each dtype, the empty one, a step where a
    tensor is absent in every micro-batch) is still one call, with the bits of every path:
    the zeros add nothing, peak at 0, and the tensor still counts as not given."""
    steps = [
        [grads(11, 1.0), grads(12, 2.0, skip=1), grads(13, 4.0, skip=0)],
        [grads(14, 1.0, skip=2), grads(15, 0.5, skip=2), grads(16, 3.0, skip=2)],
        [grads(17, 1.0, skip=4), grads(18, 2.0, skip=5), grads(19, 1.0, skip=3)],
    ]
    added = check_every_path(Case(SPEC, N_MICRO, steps))
    assert added == [AddPath.GRAPH] * 9


def test_the_zeros_for_absent_gradients_are_as_large_as_the_largest_absent_one() -> None:
    params = Case(SPEC, N_MICRO, []).params()
    reducer = ExactReducer(params, N_MICRO, **COMPILED)
    assert reducer._device is not None
    reducer.begin_step()
    reducer.add_micro_batch(grads(41, 1.0, skip=3))  # the one-element float16 tensor
    assert reducer._device._zeros[torch.float16].numel() == 1  # not the (2, 3) one's 6
    reducer.add_micro_batch(grads(42, 1.0, skip=5))  # the (2, 3) float16 tensor: it grows
    assert reducer._device._zeros[torch.float16].numel() == 6
    assert torch.float32 not in reducer._device._zeros
    assert reducer._device.last_path == AddPath.GRAPH


def test_no_step_compiles() -> None:
    """Compiled at construction: then new gradients, both layouts of the transposed one,
    a new buffer (more caller slots), a second reducer of the same tensors, and a limit of
    one graph per function: no new graph, every micro-batch one compiled call."""
    params = Case(SPEC, N_MICRO, []).params()
    first = ExactReducer(params, N_MICRO, **COMPILED)
    # The graph warmed up in the reducer's own buffer (no second data region): still +0.0.
    assert not first.buffer().any() and not first.buffer().signbit().any()
    graphs, added = counters["stats"]["unique_graphs"], []
    with torch._dynamo.config.patch(recompile_limit=1):
        second = ExactReducer(params, N_MICRO, **COMPILED)
        for step, reducer in enumerate([first, first, second]):
            reducer.set_caller_slots(1 + step)
            reducer.begin_step()
            for mb in range(N_MICRO):
                batch = grads(20 + mb, 2.0 ** (step - mb))
                if mb == 1:  # the transposed parameter's gradient contiguous: as compiled
                    batch[0] = torch.randn(5, 7)
                reducer.add_micro_batch(batch)
                assert reducer._device is not None
                added.append(reducer._device.last_path)
            assert isinstance(reducer.finish(reducer.buffer(), N_MICRO, params), ReduceDone)
    assert counters["stats"]["unique_graphs"] == graphs
    assert added == [AddPath.GRAPH] * 9


def test_a_guard_that_fails_runs_the_same_body_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Another thread count than at compilation fails a guard of the graph (global state):
    the body runs eager rather than compile in a step, with the same bits, and says so."""
    params = Case(SPEC, N_MICRO, []).params()
    reducer = ExactReducer(params, N_MICRO, **COMPILED)
    batches = [grads(31, 1.0), grads(32, 3.0, math.inf), grads(33, 0.5)]
    expected = run(Case(SPEC, N_MICRO, [batches]), {"device_ops": True}).buffers
    graphs, threads = counters["stats"]["unique_graphs"], torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        reducer.begin_step()
        with caplog.at_level(logging.WARNING, "keepstep.elastic.reduce_graph"):
            for batch, want in zip(batches, expected, strict=True):
                reducer.add_micro_batch(batch)
                assert reducer._device is not None
                assert reducer._device.last_path == AddPath.GRAPH_EAGER
                assert same_bits(reducer.buffer(), want)
    finally:
        torch.set_num_threads(threads)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum("guards failed" in r.message for r in caplog.records) == 1
