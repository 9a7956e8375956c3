"""The slow-drain option and the decision to ask (keepstep.elastic.slow_drain)."""

from __future__ import annotations

import pytest

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.slow_drain import DrainSlow, decide
from keepstep.elastic.speed import SpeedPolicy, SpeedState, StepTiming, observe

MEMBERS = ("a", "b", "c", "d")


def test_parse_and_refusals_name_the_value() -> None:
    assert DrainSlow.parse("0.25:20") == DrainSlow(0.25, 20)
    assert str(DrainSlow(0.3, 5)) == "0.3:5"
    for bad in ("0.25", "1.5:3", "0:3", "0.2:0", "x:y", "0.2:1.5", ""):
        with pytest.raises(ConfigError, match="BELOW:STEPS"):
            DrainSlow.parse(bad)


def _folded(steps: int, slow: dict[str, float], after: int = 3) -> SpeedState:
    state = SpeedState(SpeedPolicy(drain_below=0.25, drain_after=after))
    for step in range(steps):
        timings = {m: StepTiming(slow.get(m, 1.0) * 3, 3) for m in MEMBERS}
        state = observe(state, step, timings)
    return state


def test_only_the_slowest_suggested_member_asks_once() -> None:
    state = _folded(10, {"b": 10.0, "c": 20.0})
    assert state.drain == ("b", "c")
    request, reason = decide(state, 2, MEMBERS, "c", asked=False)
    assert request is not None and request.member == "c" and request.epoch == 2
    assert request.step == 9 and request.ratio == pytest.approx(1 / 20 / 0.55, rel=0.05)
    assert "below 0.25x" in reason
    assert decide(state, 2, MEMBERS, "b", asked=False)[0] is None  # not the slowest
    assert decide(state, 2, MEMBERS, "a", asked=False)[0] is None
    again, why = decide(state, 2, MEMBERS, "c", asked=True)
    assert again is None and "already" in why


def test_no_request_before_the_slow_steps_add_up() -> None:
    # Judged from step 5 (6 observations), suggested after 3 slow steps in a row: step 7.
    assert decide(_folded(7, {"b": 10.0}), 0, MEMBERS, "b", asked=False)[0] is None
    assert decide(_folded(8, {"b": 10.0}), 0, MEMBERS, "b", asked=False)[0] is not None
    assert decide(_folded(20, {}), 0, MEMBERS, "b", asked=False)[0] is None


def test_the_last_member_is_never_asked_for() -> None:
    state = _folded(10, {"b": 10.0})
    request, why = decide(state, 0, ("b",), "b", asked=False)
    assert request is None and "last member" in why
