"""The caller's slots of the reduction buffer (reduce_base.Reducer.buffer): any count of
them leaves the gradient bits as they were, the reducer never reads them, and the sum
hands every rank every rank's figure exactly.

Ranks are simulated in one process, as in test_reduce.py.
"""

from __future__ import annotations

import pytest
import torch
from reduce_ranks import N_MICRO, assert_same_bits, combine, grads_for, make_params

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.reduce import ExactReducer, ReduceDone, ReduceMode, Reducer, make_reducer

GROUPING = [[0, 5, 7], [1, 2, 3, 4], [6, 8, 9, 10, 11]]
# Compute seconds with bits all over the mantissa: float32 and float64 must carry them
# exactly (after the float32 rounding the fast buffer applies to what is written).
SECONDS = [0.1234567890123, 3.0e-5, 17.25]


def reducers(mode: ReduceMode, kernels: bool) -> list[Reducer]:
    if mode is ReduceMode.EXACT:
        return [ExactReducer(make_params(), N_MICRO, kernels=kernels) for _ in GROUPING]
    return [make_reducer(mode, make_params(), N_MICRO) for _ in GROUPING]


Grads = list[torch.Tensor | None]


def run(rs: list[Reducer], steps: int, slots: int) -> tuple[list[list[float]], Grads]:
    """Train `steps` steps; each rank writes its seconds and a flag into the caller's
    slots when there are more than one. Returns what the sum carries there, per step,
    and the last step's gradients (the same bits on every rank)."""
    params = [make_params() for _ in rs]
    read = []
    for r in rs:
        r.set_caller_slots(slots)
    for step in range(steps):
        for rank, (r, ids) in enumerate(zip(rs, GROUPING, strict=True)):
            r.begin_step()
            for mb in ids:
                r.add_micro_batch(grads_for(step, mb))
            if slots > 1:
                mine = r.buffer()[-slots:]
                mine[rank] = SECONDS[rank] * (step + 1)
                mine[-1] = 1.0 if rank == 1 else 0.0
        reduced = combine([r.buffer() for r in rs], step)
        read.append(reduced[-slots:].tolist())
        for r, p in zip(rs, params, strict=True):
            assert isinstance(r.finish(reduced.clone(), N_MICRO, p), ReduceDone)
        for p in params[1:]:
            assert_same_bits([q.grad for q in params[0]], [q.grad for q in p])
    return read, [q.grad for q in params[0]]


@pytest.mark.parametrize(
    ("mode", "kernels"),
    [(ReduceMode.EXACT, True), (ReduceMode.EXACT, False), (ReduceMode.FAST, False)],
)
def test_caller_slots_leave_the_gradient_bits_and_carry_each_ranks_figure(
    mode: ReduceMode, kernels: bool
) -> None:
    if kernels:
        pytest.importorskip("numba")
    _, plain = run(reducers(mode, False), 3, 1)
    rs = reducers(mode, kernels)
    read, grads = run(rs, 3, 1 + len(GROUPING))
    assert_same_bits(plain, grads)
    dtype = rs[0].buffer().dtype
    for step, values in enumerate(read):
        expected = [torch.tensor(s * (step + 1), dtype=dtype).item() for s in SECONDS]
        assert values == [*expected, 1.0]  # x + 0 = x: exact, in any order of the sum
    # Back to one slot: a fresh buffer of the old size, the same bits again.
    for r in rs:
        r.set_caller_slots(1)
    assert rs[0].buffer().numel() == reducers(mode, False)[0].buffer().numel()


@pytest.mark.parametrize("count", [0, -1, True, 1.5])
def test_a_bad_slot_count_is_named(count: object) -> None:
    for mode in ReduceMode:
        with pytest.raises(ConfigError, match="caller_slots"):
            make_reducer(mode, make_params(), N_MICRO).set_caller_slots(count)  # type: ignore[arg-type]
