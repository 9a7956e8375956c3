"""Tests of keepstep.elastic.reduce: exact mode is bit-identical under any grouping of
micro-batches onto ranks and any combine order; fast mode's deviation is measured.

Ranks are simulated in one process (reduce_ranks.py): each rank is a Reducer fed its
micro-batches, and the all-reduce is an explicit sum of their buffers in a chosen order
(the exact reducer's buffers hold integers that float64 adds exactly, so only the reducer
can make the results differ).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch
from reduce_ranks import (
    N_MICRO,
    SPEC,
    Grads,
    Ranks,
    assert_same_bits,
    combine,
    exact,
    grads_for,
    groupings,
    make_params,
    reference,
)

from keepstep.elastic.errors import ConfigError, KeepstepError, StateShapeError
from keepstep.elastic.reduce import (
    ExactReducer,
    ReduceDone,
    ReduceMode,
    ReduceNonFinite,
    ReduceOverflow,
    make_reducer,
)


def test_exact_is_bit_identical_across_groupings_orders_and_steps() -> None:
    jobs = [Ranks(g, how) for how, g in enumerate(groupings())]
    initial = exact(jobs[0].reducers[0]).exponents
    for step in range(4):
        results = []
        for job in jobs:
            assert all(isinstance(o, ReduceDone) for o in job.step(step))
            results.append(job.grads())
            assert len({exact(rd).exponents for rd in job.reducers}) == 1
        for other in results[1:]:
            assert_same_bits(results[0], other)
        assert len({exact(job.reducers[0]).exponents for job in jobs}) == 1
    # The exponent state was carried: it moved away from the first step's range.
    assert exact(jobs[0].reducers[0]).exponents != initial


def test_exact_is_close_to_float64_reference() -> None:
    job = Ranks([list(range(0, N_MICRO, 2)), list(range(1, N_MICRO, 2))], 0)
    for step in range(3):
        ks = exact(job.reducers[0]).exponents
        assert all(isinstance(o, ReduceDone) for o in job.step(step))
        for i, (got, ref) in enumerate(zip(job.grads(), reference(step), strict=True)):
            if got is None:
                continue
            info = torch.finfo(got.dtype)
            # Rounding each micro-batch to 2**-k costs <= 0.5 * 2**-k in the mean; then
            # one rounding to the parameter dtype (relative eps, or the subnormal spacing).
            bound = 0.5 * 2.0 ** -ks[i] + info.eps * ref.abs() + info.eps * info.smallest_normal
            err = (got.double() - ref).abs()
            assert bool((err <= bound * (1 + 1e-9)).all()), f"step {step} tensor {i}"
            # From step 1 on, k follows the tensor's own scale (step 0 covers |g| <= 2**16,
            # coarse for the 1e-8 tensor but still within the bound above).
            if step and ref.numel() and SPEC[i][1] in (torch.float32, torch.float64):
                rel = float(err.norm() / ref.norm()) if ref.norm() > 0 else float(err.norm())
                assert rel < 1e-6, f"step {step} tensor {i}: relative error {rel}"


def spike(step: int, mb: int, grads: Grads) -> None:
    if step == 1 and mb == 5:
        g = grads[0]
        assert g is not None
        grads[0] = g * 2.0**20  # far beyond the 2**8 headroom over last step's peaks


def test_overflow_retries_to_identical_results() -> None:
    jobs = [Ranks(g, how) for how, g in enumerate(groupings())]
    results = []
    for job in jobs:
        assert all(isinstance(o, ReduceDone) for o in job.step(0))
        assert job.step(1, spike) == [ReduceOverflow(micro_batches=1)] * len(job.reducers)
        job.retry_exponents()
        assert all(isinstance(o, ReduceDone) for o in job.step(1, spike))
        results.append(job.grads())
    for other in results[1:]:
        assert_same_bits(results[0], other)
    ref, got = reference(1, spike)[0], results[0][0]
    assert got is not None and float((got.double() - ref).norm() / ref.norm()) < 1e-6
    # The step after the retry is identical again, with exponents derived from the retry.
    after = []
    for job in jobs:
        assert all(isinstance(o, ReduceDone) for o in job.step(2))
        after.append(job.grads())
    for other in after[1:]:
        assert_same_bits(after[0], other)


def test_huge_and_tiny_gradients_reach_the_clamped_exponents() -> None:
    def extreme(step: int, mb: int, grads: Grads) -> None:
        f64, f32 = grads[1], grads[0]
        assert f64 is not None and f32 is not None
        grads[1] = f64 * 1e200  # needs a negative exponent
        grads[0] = f32 * 1e-30  # wants k > 125; the clamp keeps 2**k a normal float32

    job = Ranks([list(range(5)), list(range(5, N_MICRO))], 2)
    assert isinstance(job.step(0, extreme)[0], ReduceOverflow)  # 1e203 >> initial 2**16
    job.retry_exponents()
    assert all(isinstance(o, ReduceDone) for o in job.step(0, extreme))
    ks = exact(job.reducers[0]).exponents
    assert ks[1] < -500 and ks[0] == 125
    ref = reference(0, extreme)
    got = [g.double() if g is not None else None for g in job.grads()]
    assert got[0] is not None and got[1] is not None
    # max-abs, not norm: the norm of 1e202-sized values overflows float64.
    assert float((got[1] - ref[1]).abs().max() / ref[1].abs().max()) < 1e-12
    assert float((got[0] - ref[0]).abs().max()) <= 2.0**-125


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_gradients_are_reported_on_every_grouping(value: float) -> None:
    def poison(step: int, mb: int, grads: Grads) -> None:
        if mb == 7:
            g = grads[1]
            assert g is not None
            g[3] = value
        if mb == 2:
            spike(1, 5, grads)  # an overflow too: non-finite must win

    for how, g in enumerate(groupings()):
        outcomes = Ranks(g, how).step(1, poison)
        assert len(set(outcomes)) == 1
        assert isinstance(outcomes[0], ReduceNonFinite)
        assert outcomes[0].reason.startswith("1 of 12 micro-batches")
        assert "param indices 1)" in outcomes[0].reason


def test_state_dict_round_trip_reproduces_the_next_step() -> None:
    grouping = [list(range(N_MICRO))]
    a = Ranks(grouping, 0)
    a.step(0)
    state = {k: v.clone() for k, v in a.reducers[0].state_dict().items()}
    b = Ranks(grouping, 0)
    fresh = exact(b.reducers[0]).exponents
    b.reducers[0].load_state_dict(state)
    assert exact(b.reducers[0]).exponents == exact(a.reducers[0]).exponents != fresh
    a.step(1)
    b.step(1)
    assert_same_bits(a.grads(), b.grads())
    assert exact(b.reducers[0]).exponents == exact(a.reducers[0]).exponents


def test_bad_state_is_refused() -> None:
    reducer = make_reducer(ReduceMode.EXACT, make_params(), N_MICRO)
    good = reducer.state_dict()
    with pytest.raises(StateShapeError, match="keys"):
        reducer.load_state_dict({"exponents": good["exponents"]})
    with pytest.raises(StateShapeError, match="'peak'"):
        reducer.load_state_dict({**good, "peak": good["peak"][:2]})
    with pytest.raises(StateShapeError, match="limit_bits=57"):
        reducer.load_state_dict({**good, "limit_bits": torch.tensor(57)})
    with pytest.raises(StateShapeError, match="out of range"):
        reducer.load_state_dict({**good, "exponents": good["exponents"] + 10_000})


def test_fast_mode_deviation_is_small_but_measured() -> None:
    results = []
    for how, g in enumerate(groupings()):
        job = Ranks(g, how, ReduceMode.FAST)
        assert all(isinstance(o, ReduceDone) for o in job.step(0))
        results.append(job.grads())
    ref, ref_abs = reference(0), reference(0, absolute=True)
    worst_abs, worst_rel = 0.0, 0.0
    for i, r in enumerate(ref):
        if r.numel() == 0 or not r.abs().max() > 0:
            continue
        for res in results:
            got, first = res[i], results[0][i]
            assert got is not None and first is not None
            dev = float((got.double() - first.double()).abs().max())
            worst_abs = max(worst_abs, dev)
            worst_rel = max(worst_rel, dev / float(r.abs().max()))
            # Close to float64: N_MICRO float32 additions, then the parameter dtype.
            eps32, eps = torch.finfo(torch.float32).eps, torch.finfo(got.dtype).eps
            bound = N_MICRO * eps32 * ref_abs[i] + eps * r.abs()
            assert bool(((got.double() - r).abs() <= bound).all()), f"tensor {i}"
    print(f"\nfast mode: max deviation across groupings abs={worst_abs:.3e} rel={worst_rel:.3e}")
    assert worst_rel < 1e-5


def test_fast_mode_reports_non_finite_and_has_no_retry() -> None:
    params = make_params()
    reducer = make_reducer(ReduceMode.FAST, params, N_MICRO)
    reducer.begin_step()
    grads = grads_for(0, 1)
    g = grads[2]
    assert g is not None
    g[0, 0, 0] = math.inf
    reducer.add_micro_batch(grads)
    outcome = reducer.finish(reducer.buffer(), N_MICRO, params)
    assert isinstance(outcome, ReduceNonFinite) and "param indices 2)" in outcome.reason
    with pytest.raises(KeepstepError, match="fast mode"):
        reducer.retry_max_buffer()
    assert reducer.state_dict() == {}
    with pytest.raises(StateShapeError, match="exponents"):
        reducer.load_state_dict({"exponents": torch.zeros(6, dtype=torch.int64)})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_micro": 0}, "n_micro=0"),
        ({"n_micro": True}, "n_micro=True"),
        ({"n_micro": 2.0}, "n_micro=2.0"),
        ({"n_micro": 2**25}, "n_micro=33554432"),
        ({"headroom_bits": -1}, "headroom_bits=-1"),
        ({"headroom_bits": 40}, "headroom_bits=40"),
        ({"initial_max": 0.0}, "initial_max=0.0"),
        ({"initial_max": math.nan}, "initial_max=nan"),
        ({"params": []}, "non-empty"),
        ({"params": [torch.zeros(3, dtype=torch.int64)]}, r"params\[0\] has dtype torch.int64"),
        ({"params": [torch.zeros(2), "w"]}, r"params\[1\] is a str"),
        ({"mode": "bogus"}, "mode='bogus'"),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"mode": ReduceMode.EXACT, "params": make_params(), "n_micro": 4}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        make_reducer(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(ReduceMode))
def test_mismatched_gradients_and_buffers_are_refused(mode: ReduceMode) -> None:
    params = make_params()
    reducer = make_reducer(mode, params, N_MICRO)
    reducer.begin_step()
    grads = grads_for(0, 1)
    with pytest.raises(StateShapeError, match="got 5 gradients for 6"):
        reducer.add_micro_batch(grads[:5])
    with pytest.raises(StateShapeError, match="gradient 0"):
        reducer.add_micro_batch([torch.zeros(5, 7), *grads[1:]])
    with pytest.raises(StateShapeError, match="gradient 1"):
        reducer.add_micro_batch([grads[0], torch.zeros(13), *grads[2:]])
    with pytest.raises(ConfigError, match="n_micro=3"):
        reducer.finish(reducer.buffer(), 3, params)
    with pytest.raises(StateShapeError, match="reduced buffer"):
        reducer.finish(reducer.buffer()[:-1], N_MICRO, params)
    with pytest.raises(StateShapeError, match="params differ"):
        reducer.finish(reducer.buffer(), N_MICRO, params[:-1])
    assert ReduceMode("exact") is ReduceMode.EXACT
    with pytest.raises(ConfigError, match="micro_batches=0"):
        ReduceOverflow(micro_batches=0)


def test_each_micro_batch_rounds_half_to_even_at_the_agreed_exponent() -> None:
    params = [torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float32)]
    reducer = exact(make_reducer(ReduceMode.EXACT, params, 2, initial_max=2.0**16))
    k = reducer.limit_bits - 16  # the first step covers |g| <= initial_max exactly
    assert reducer.limit_bits == 52 and reducer.exponents == (k, k)
    unit = 2.0**-k
    units = [0.3, 0.5, 1.5, -2.5, 3.75, 1e6 + 0.5]
    grads = [
        torch.tensor([u * unit for u in units], dtype=torch.float64),
        torch.tensor([u * unit for u in units], dtype=torch.float32),
    ]
    reducer.begin_step()
    reducer.add_micro_batch(grads)
    reducer.add_micro_batch(grads)  # two identical micro-batches: each is rounded alone
    assert isinstance(reducer.finish(reducer.buffer(), 2, params), ReduceDone)
    for p, g in zip(params, grads, strict=True):
        # Python's round() is round-half-to-even on the exact float64 product.
        want = [2 * round(x * 2.0**k) * unit / 2 for x in g.double().tolist()]
        assert p.grad is not None
        assert p.grad.tolist() == [float(torch.tensor(w, dtype=p.dtype)) for w in want]
    assert params[0].grad is not None and params[0].grad[:2].tolist() == [0.0, 0.0]


def test_overflow_is_decided_exactly_at_the_limit() -> None:
    params = [torch.zeros(3, dtype=torch.float64)]
    reducer = exact(make_reducer(ReduceMode.EXACT, params, 1, initial_max=2.0**16))
    at_limit = torch.tensor([2.0**16, -(2.0**16), 1.0], dtype=torch.float64)  # q = +-2**53
    reducer.begin_step()
    reducer.add_micro_batch([at_limit])
    assert isinstance(reducer.finish(reducer.buffer(), 1, params), ReduceDone)
    assert params[0].grad is not None and torch.equal(params[0].grad, at_limit)

    reducer = exact(make_reducer(ReduceMode.EXACT, params, 1, initial_max=2.0**16))
    reducer.begin_step()
    reducer.add_micro_batch([at_limit * (1 + 2.0**-52)])  # one float64 ulp past the limit
    assert reducer.finish(reducer.buffer(), 1, params) == ReduceOverflow(micro_batches=1)
    assert reducer.retry_max_buffer().tolist() == [2.0**16 * (1 + 2.0**-52)]


def test_sums_at_the_limit_stay_exact_integers_in_any_order() -> None:
    """The buffer holds integers in float64: n_micro quantized values at the limit must
    still add exactly (an odd partial sum past 2**53 would round)."""
    n_micro = 4
    params = [torch.zeros(1, dtype=torch.float64)]
    probe = exact(make_reducer(ReduceMode.EXACT, params, n_micro, initial_max=1.0))
    k = probe.limit_bits  # initial_max 1.0: q = g * 2**limit_bits
    assert probe.limit_bits == 51 and probe.exponents == (k,)
    numerators = [2**k - 1, 2**k - 3, 2**k - 5, -(2**k - 7)]
    grads = [torch.tensor([q * 2.0**-k], dtype=torch.float64) for q in numerators]
    want = Fraction(sum(numerators), n_micro * 2**k)
    results = set()
    for grouping in ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[3], [1, 0, 2]], [[0], [1], [2], [3]]):
        for how in range(4):
            buffers = []
            for mbs in grouping:
                reducer = exact(make_reducer(ReduceMode.EXACT, params, n_micro, initial_max=1.0))
                reducer.begin_step()
                for mb in mbs:
                    reducer.add_micro_batch([grads[mb]])
                buffers.append(reducer.buffer())
            assert isinstance(reducer.finish(combine(buffers, how), n_micro, params), ReduceDone)
            assert params[0].grad is not None
            results.add(params[0].grad.item())
    assert results == {float(want)}


def test_fused_kernels_give_the_same_bits() -> None:
    """The multi-tensor path used off the CPU, run here, against the CPU path."""
    outs = []
    for fused in (False, True):
        params = make_params()
        reducer = ExactReducer(params, N_MICRO, fused=fused)
        for step in range(2):
            reducer.begin_step()
            for mb in range(N_MICRO):
                reducer.add_micro_batch(grads_for(step, mb))
            assert isinstance(reducer.finish(reducer.buffer(), N_MICRO, params), ReduceDone)
        outs.append(([p.grad for p in params], reducer.exponents))
    assert_same_bits(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1]


@pytest.mark.parametrize("mode", list(ReduceMode))
def test_a_step_without_any_gradient_leaves_grad_none(mode: ReduceMode) -> None:
    params = make_params()
    for p in params:
        p.grad = torch.ones_like(p)  # stale: finish must clear it
    reducer = make_reducer(mode, params, 2)
    reducer.begin_step()
    reducer.add_micro_batch([None] * len(params))
    assert isinstance(reducer.finish(reducer.buffer(), 2, params), ReduceDone)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("mode", list(ReduceMode))
def test_an_abandoned_buffer_is_replaced_and_never_read_again(mode: ReduceMode) -> None:
    # A collective that was given up may still complete later and write into the tensor it
    # was handed (comm/): after abandon_buffer, nothing written there reaches a step.
    grouping = [list(range(N_MICRO))]
    clean, hit = Ranks(grouping, 0, mode), Ranks(grouping, 0, mode)
    reducer = hit.reducers[0]
    reducer.begin_step()
    reducer.add_micro_batch(grads_for(0, 0))
    stale = reducer.buffer()
    reducer.abandon_buffer()
    fresh = reducer.buffer()
    assert fresh.data_ptr() != stale.data_ptr()
    assert (fresh.shape, fresh.dtype) == (stale.shape, stale.dtype)
    stale.fill_(7)  # the late write of the dead epoch's work
    assert clean.step(0) == hit.step(0) == [ReduceDone()]
    assert_same_bits(clean.grads(), hit.grads())
    stale.fill_(-3)
    clean.step(1)
    hit.step(1)
    assert_same_bits(clean.grads(), hit.grads())


@pytest.mark.parametrize("mode", list(ReduceMode))
def test_the_callers_last_element_is_summed_and_never_read(mode: ReduceMode) -> None:
    # Step counts the members announcing a planned change in the buffer's last element.
    grouping = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    plain, marked = Ranks(grouping, 0, mode), Ranks(grouping, 0, mode)
    for r, reducer in enumerate(marked.reducers):
        reducer.begin_step()
        ids = grouping[r]
        for mb in random.Random(r).sample(ids, len(ids)):  # Ranks.step's order (fast mode)
            reducer.add_micro_batch(grads_for(0, mb))
        assert reducer.buffer()[-1] == 0  # begin_step zeroed it
        reducer.buffer()[-1] = r + 1
    reduced = combine([rd.buffer() for rd in marked.reducers], 0)
    assert reduced[-1] == 1 + 2 + 3
    outcomes = [
        rd.finish(reduced.clone(), N_MICRO, p)
        for rd, p in zip(marked.reducers, marked.params, strict=True)
    ]
    assert outcomes == plain.step(0) == [ReduceDone()] * 3
    assert_same_bits(plain.grads(), marked.grads())
