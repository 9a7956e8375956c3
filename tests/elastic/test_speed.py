"""Tests of keepstep.elastic.speed: weights from synthetic step timings, and their stability.

Timings are generated, never measured: each member has a true seconds-per-micro-batch at
each step, multiplied by seeded noise, so every test is exact and replayable.
"""

from __future__ import annotations

import random
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.plan import plan
from keepstep.elastic.speed import SpeedPolicy, SpeedState, StepTiming, observe

# The machine is small and shared: no per-example deadline, a modest example count.
FAST = settings(max_examples=60, deadline=None)
FOUR = ("n0", "n1", "n2", "n3")
N_MICRO = 64
POLICY = SpeedPolicy()
# Steps from a lasting change to the new weights: the window's median flips after
# window // 2 + 1 new observations, then the change must hold for confirm_steps.
LAG = POLICY.window // 2 + POLICY.confirm_steps - 1


def _timings(
    seconds: Mapping[str, float], weights: Mapping[str, float], rng: random.Random, noise: float
) -> dict[str, StepTiming]:
    """One step: each member computes its planned count at its (noisy) seconds each."""
    counts = {m: len(ids) for m, ids in plan(0, sorted(seconds), N_MICRO, 1, weights).items()}
    return {
        m: StepTiming(counts[m] * s * rng.uniform(1 - noise, 1 + noise), counts[m])
        for m, s in seconds.items()
    }


def _run(
    seconds_at: Callable[[int], Mapping[str, float]],
    steps: int,
    seed: int = 0,
    noise: float = 0.2,
    policy: SpeedPolicy = POLICY,
    state: SpeedState | None = None,
) -> list[SpeedState]:
    rng = random.Random(seed)
    states = [state or SpeedState(policy)]
    for step in range(states[0].step + 1, states[0].step + 1 + steps):
        seconds = seconds_at(step)
        last = states[-1]
        weights = {m: last.weights.get(m, 1.0) for m in seconds}
        states.append(observe(last, step, _timings(seconds, weights, rng, noise)))
    return states[1:]


def _replans(states: list[SpeedState]) -> list[int]:
    return [s.step for s in states if s.replanned]


def _equal(step: int) -> dict[str, float]:
    return dict.fromkeys(FOUR, 1.0)


def _throttled(
    start: int, end: int = 10**9, factor: float = 3.0
) -> Callable[[int], dict[str, float]]:
    def seconds(step: int) -> dict[str, float]:
        return {m: factor if m == "n3" and start <= step < end else 1.0 for m in FOUR}

    return seconds


def _counts(weights: Mapping[str, float]) -> dict[str, int]:
    return {m: len(ids) for m, ids in plan(0, sorted(weights), N_MICRO, 1, weights).items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_members_never_replan_under_noise(seed: int) -> None:
    states = _run(_equal, 1000, seed=seed, noise=0.2)
    assert _replans(states) == []
    assert states[-1].weights == dict.fromkeys(FOUR, 1.0)
    assert "weights stand (4/4 members judged)" in states[-1].reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_throttled_member_gets_a_third_once(seed: int) -> None:
    states = _run(_throttled(50), 400, seed=seed)
    replans = _replans(states)
    assert len(replans) == 1, [(s.step, s.reason) for s in states if s.replanned]
    assert 50 + LAG <= replans[0] <= 50 + LAG + 3
    assert re.search(
        r"step \d+: new weights: shares of \[.*'n3'\] moved by more than 20% for 5 steps",
        states[replans[0]].reason,
    )
    weights = states[-1].weights
    others = statistics.median(weights[m] for m in FOUR[:3])
    assert weights["n3"] / others == pytest.approx(1 / 3, rel=0.12)
    counts = _counts(weights)
    assert sum(counts.values()) == N_MICRO
    assert counts["n3"] / statistics.mean(counts[m] for m in FOUR[:3]) == pytest.approx(
        1 / 3, rel=0.2
    )
    assert 5 <= counts["n3"] <= 8, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_lifted_throttle_gives_the_weights_back_once(seed: int) -> None:
    states = _run(_throttled(50, 300), 700, seed=seed)
    replans = _replans(states)
    assert len(replans) == 2, replans
    assert 300 + LAG <= replans[1] <= 300 + LAG + 3
    assert all(0.9 <= w <= 1.1 for w in states[-1].weights.values()), states[-1].weights
    assert all(15 <= c <= 17 for c in _counts(states[-1].weights).values())


def test_milder_slowdowns() -> None:
    # Half speed is followed; a 10% slowdown stays inside the hysteresis band.
    assert len(_replans(_run(_throttled(20, factor=2.0), 200, noise=0.05))) == 1
    assert _replans(_run(_throttled(20, factor=1.1), 300, noise=0.05)) == []


def test_one_off_spikes_never_replan() -> None:
    def spiky(step: int) -> dict[str, float]:
        seconds = dict.fromkeys(FOUR, 1.0)
        if step % 37 == 0:
            seconds["n1"] = 50.0  # a GC pause
        if step % 101 == 0:
            seconds = dict.fromkeys(FOUR, 20.0)  # everyone at once
        if 200 <= step < 200 + POLICY.window // 2:
            seconds["n2"] = 30.0  # a burst, under half a window long
        return seconds

    states = _run(spiky, 600, noise=0.1)
    assert _replans(states) == []
    assert states[-1].weights == dict.fromkeys(FOUR, 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_random_spikes_never_replan(seed: int) -> None:
    rng = random.Random(seed)
    spikes = {(s, m) for s in range(1000) for m in FOUR if rng.random() < 0.02}

    def seconds(step: int) -> dict[str, float]:
        return {m: 25.0 if (step, m) in spikes else 1.0 for m in FOUR}

    assert _replans(_run(seconds, 1000, seed=seed, noise=0.2)) == []


def test_drain_only_when_enabled() -> None:
    crawl = _throttled(30, 200, factor=5.0)  # a fifth of the speed: below 0.25 x median
    off = _run(crawl, 250)
    assert all(s.drain == () for s in off)

    on = _run(crawl, 250, policy=SpeedPolicy(drain_after=20))
    drained = [s.step for s in on if s.drain]
    assert drained and all(on[step].drain == ("n3",) for step in drained)
    # Slow from the window's flip (30 + window // 2) on, suggested 20 steps later.
    assert drained[0] == 30 + POLICY.window // 2 + 19
    assert "drain suggested for ['n3'] (below 0.25x median)" in on[drained[0]].reason
    # Back to speed: the median flips again and the suggestion stops.
    assert drained[-1] == 200 + POLICY.window // 2 - 1
    assert on[-1].slow["n3"] == 0


def test_a_third_of_the_speed_is_not_drained() -> None:
    states = _run(_throttled(10), 300, policy=SpeedPolicy(drain_after=5))
    assert all(s.drain == () for s in states)
    assert len(_replans(states)) == 1


def test_a_joiner_starts_at_the_median_and_is_judged_later() -> None:
    three = ("a", "b", "c")
    before = _run(lambda step: {m: 3.0 if m == "c" else 1.0 for m in three}, 100)
    assert len(_replans(before)) == 1
    assert before[-1].weights["c"] == pytest.approx(1 / 3, rel=0.12)

    def with_d(step: int) -> dict[str, float]:
        return {"a": 1.0, "b": 1.0, "c": 3.0, "d": 1.5}

    after = _run(with_d, 60, state=before[-1])
    first = after[0]
    assert first.weights["d"] == 1.0  # the median weight of a, b, c
    assert first.seen["d"] == 1
    assert "members joined ['d'], left []" in first.reason
    assert not first.replanned
    replans = _replans(after)
    # Judged from its min_observations-th step; its share then moves for confirm_steps.
    assert replans == [100 + POLICY.min_observations - 1 + POLICY.confirm_steps - 1]
    weights = after[-1].weights
    assert weights["d"] / weights["a"] == pytest.approx(2 / 3, rel=0.12)
    assert weights["c"] / weights["a"] == pytest.approx(1 / 3, rel=0.12)


def test_a_member_that_leaves_is_forgotten() -> None:
    states = _run(_throttled(0), 60)
    assert len(_replans(states)) == 1
    gone = _run(lambda step: dict.fromkeys(FOUR[:3], 1.0), 1, state=states[-1])[0]
    assert set(gone.weights) == set(gone.recent) == set(gone.seen) == set(FOUR[:3])
    assert "left ['n3']" in gone.reason
    assert not gone.replanned
    back = _run(_throttled(0), 1, state=gone)[0]
    assert back.seen["n3"] == 1  # a stranger again: not judged on its old timings
    assert back.weights["n3"] == 1.0


def test_a_change_of_members_restarts_the_confirmation() -> None:
    states = _run(_throttled(0), POLICY.window // 2 + 2)
    assert states[-1].pending == 2
    joined = _run(lambda step: {**_throttled(0)(step), "n4": 1.0}, 1, state=states[-1])[0]
    assert joined.pending == 1


def test_deterministic_and_independent_of_input_order() -> None:
    rng = random.Random(7)
    steps = []
    for step in range(200):
        seconds = {m: (3.0 if m == "n3" and step > 40 else 1.0) for m in FOUR}
        steps.append(
            {m: StepTiming(16 * s * rng.uniform(0.8, 1.2), 16) for m, s in seconds.items()}
        )
    forward, backward, again = SpeedState(), SpeedState(), SpeedState()
    for step, timings in enumerate(steps):
        forward = observe(forward, step, timings)
        backward = observe(backward, step, dict(reversed(list(timings.items()))))
        again = observe(again, step, dict(timings))
        assert forward == backward == again
        assert forward.reason == backward.reason
        assert list(forward.weights) == sorted(FOUR)
        # Bit for bit, not approximately: every member plans from these floats.
        assert [w.hex() for w in forward.weights.values()] == [
            w.hex() for w in backward.weights.values()
        ]
    assert forward.seconds_per_micro_batch() == backward.seconds_per_micro_batch()


def test_replaying_an_observed_step_changes_nothing() -> None:
    states = _run(_throttled(0), 30)
    last = states[-1]
    timings = {m: StepTiming(100.0, 1) for m in FOUR}
    replayed = observe(last, 10, timings)
    assert replayed.reason == "step 10: already observed (last 29); nothing changes"
    assert (replayed.weights, replayed.recent, replayed.pending) == (
        last.weights,
        last.recent,
        last.pending,
    )
    assert observe(last, 29, timings).recent == last.recent


def test_steps_without_information_are_skipped() -> None:
    state = observe(SpeedState(), 0, {"a": StepTiming(0.0, 4), "b": StepTiming(1.0, 0)})
    assert state.seen == {"a": 0, "b": 0}
    assert state.recent == {"a": (), "b": ()}
    state = observe(state, 1, {"a": StepTiming(2.0, 4), "b": StepTiming(1.0, 1)})
    assert state.recent == {"a": (0.5,), "b": (1.0,)}


def test_estimates_are_clipped_means() -> None:
    policy = SpeedPolicy(window=5, min_observations=5)
    state = SpeedState(policy)
    for step, seconds in enumerate([1.0, 1.2, 0.8, 40.0, 1.0]):
        state = observe(state, step, {"a": StepTiming(seconds, 1), "b": StepTiming(2.0, 1)})
    assert state.seconds_per_micro_batch() == {"a": 1.0, "b": 2.0}  # the 40 s spike dropped


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"window": 0}, r"SpeedPolicy window=0 must be an int >= 1"),
        ({"window": 2.5}, r"SpeedPolicy window=2\.5 must be an int >= 1"),
        ({"min_observations": 0}, r"min_observations=0 must be an int >= 1"),
        ({"min_observations": 12}, r"min_observations=12 must be <= window=11"),
        ({"grid_step": 0.0}, r"grid_step=0\.0 must be a number in \(0, 1\)"),
        ({"grid_step": 1}, r"grid_step=1 must be a number in \(0, 1\)"),
        ({"threshold": float("nan")}, r"threshold=nan must be a number in \(0, 1\)"),
        ({"threshold": True}, r"threshold=True must be a number in \(0, 1\)"),
        ({"confirm_steps": 0}, r"confirm_steps=0 must be an int >= 1"),
        ({"drain_below": 1.5}, r"drain_below=1\.5 must be a number in \(0, 1\)"),
        ({"drain_after": 0}, r"drain_after=0 must be an int >= 1"),
        ({"drain_after": True}, r"drain_after=True must be an int >= 1"),
    ],
)
def test_policy_validation(knobs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SpeedPolicy(**knobs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("compute_s", "micro_batches", "match"),
    [
        (-1.0, 1, r"compute_s=-1\.0 must be a number of seconds in \[0, 1e\+09\]"),
        (float("inf"), 1, r"compute_s=inf"),
        (float("nan"), 1, r"compute_s=nan"),
        ("1", 1, r"compute_s='1'"),
        (1.0, -1, r"micro_batches=-1 must be an int >= 0"),
        (1.0, 2.0, r"micro_batches=2\.0 must be an int >= 0"),
    ],
)
def test_timing_validation(compute_s: object, micro_batches: object, match: str) -> None:
    with pytest.raises(BadMessage, match=match):
        StepTiming(compute_s, micro_batches)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "timings", "match"),
    [
        (-1, {"a": StepTiming(1.0, 1)}, r"step=-1 must be an int >= 0"),
        (True, {"a": StepTiming(1.0, 1)}, r"step=True must be an int >= 0"),
        (0, {}, r"timings=\{\} must be a non-empty mapping"),
        (0, [("a", StepTiming(1.0, 1))], r"must be a non-empty mapping"),
        (0, {"": StepTiming(1.0, 1)}, r"member id '' in timings must be a non-empty str"),
        (0, {"a": (1.0, 1)}, r"timing \(1\.0, 1\) of member 'a' must be a StepTiming"),
    ],
)
def test_observe_validation(step: object, timings: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        observe(SpeedState(), step, timings)  # type: ignore[arg-type]


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, StepTiming]]:
    """Steps of timings from a changing cast: speeds spanning 1000x, joins and leaves."""
    pool = [f"m{i}" for i in range(6)]
    speed = {m: draw(st.floats(1e-3, 1.0)) for m in pool}
    out = []
    for _ in range(draw(st.integers(1, 80))):
        members = draw(st.sets(st.sampled_from(pool), min_size=1))
        out.append(
            {
                m: StepTiming(
                    draw(st.integers(0, 8)) * speed[m] * draw(st.floats(0.5, 2.0)),
                    draw(st.integers(0, 8)),
                )
                for m in sorted(members)
            }
        )
    return out


@FAST
@given(histories(), st.sampled_from([POLICY, SpeedPolicy(window=3, min_observations=1)]))
def test_weights_are_always_usable(
    history: list[dict[str, StepTiming]], policy: SpeedPolicy
) -> None:
    state = SpeedState(policy)
    last_replan = None
    for step, timings in enumerate(history):
        state = observe(state, step, timings)
        assert list(state.weights) == sorted(timings)
        assert all(1e-3 <= w <= 1e3 for w in state.weights.values())  # positive and finite
        counts = _counts(state.weights) if len(timings) <= N_MICRO else {}
        assert sum(counts.values()) in (0, N_MICRO)
        if state.replanned:
            # Two changes of weights are never closer than the confirmation.
            assert last_replan is None or step - last_replan >= policy.confirm_steps
            last_replan = step
            # Normalised to the median speed: weight 1 lies between the judged members'.
            judged = [
                w for m, w in state.weights.items() if state.seen[m] >= policy.min_observations
            ]
            assert min(judged) <= 1.0 <= max(judged)


@FAST
@given(histories(), st.randoms(use_true_random=False))
def test_the_order_of_timings_never_matters(
    history: list[dict[str, StepTiming]], rng: random.Random
) -> None:
    ordered, shuffled = SpeedState(), SpeedState()
    for step, timings in enumerate(history):
        items = list(timings.items())
        rng.shuffle(items)
        ordered = observe(ordered, step, timings)
        shuffled = observe(shuffled, step, dict(items))
        assert ordered == shuffled


def test_the_module_imports_no_torch() -> None:
    # The agents may fold timings without torch; see tests/test_imports.py for the pattern.
    probe = "import sys, keepstep.elastic.speed; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert not {"torch", "numpy"} & set(done.stdout.split())


def test_members_beyond_the_ratio_bound_get_its_last_grid_points() -> None:
    """A member 5000x slower and one 10,000x faster than the median: their weights are the
    grid's ends, within 1000x of the median either way (the grid once ran a point past
    the bound, a weight of 1020)."""
    policy = SpeedPolicy(window=3, min_observations=1, confirm_steps=1)
    per_mb = {"m0": 1.0, "m1": 5000.0, "m2": 1.0, "m3": 1e-4, "m4": 1.0}
    state = SpeedState(policy)
    for step in range(3):
        state = observe(state, step, {m: StepTiming(2 * s, 2) for m, s in per_mb.items()})
    weights = state.weights
    assert weights["m0"] == weights["m2"] == weights["m4"] == 1.0
    assert 1e-3 <= weights["m1"] < 1.1e-3 and 900 < weights["m3"] <= 1e3
