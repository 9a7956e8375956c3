"""Per-member speed from step timings, turned into plan weights that do not flap.

Where it sits: the straggler path in front of ``plan(..., weights)`` (plan.py). After each
committed step the caller gathers every member's compute seconds (time spent computing its
micro-batches, collective waits excluded) and micro-batch count, and folds them in step
order into a :class:`SpeedState` with :func:`observe`. The state says which weights the
plan should use, whether this observation changed them (a planned change, switched at a
step boundary by the caller) and which members it would drain. Torch-free and pure: the
same observations in the same order give the same state on every member, bit for bit.
Only comparisons and IEEE-rounded ``+ - * /`` touch the floats (no log, no pow), so every
CPython computes the same numbers.

Why a clipped mean: a member's seconds per micro-batch is the mean of its last ``window``
observations after dropping those more than 1.5x away from the window's median. A one-off
spike (a GC pause, a cache flush, a recompile) is dropped entirely, as by a median, and
any ``window // 2`` of them together are; ordinary noise averages out with a mean's
spread, which on +-20% uniform noise is about 0.6x a median's (with a plain median the
weights flapped under the noise of tests/elastic/test_speed.py). A lasting change moves the
median after ``window // 2 + 1`` steps, and the clip then keeps only the new regime: a
known lag.

The decision, per observed step:

1. speed = 1 / seconds per micro-batch, for members with at least ``min_observations``;
   the others (joiners) keep the weight they were given.
2. candidate weight = speed / median speed, rounded to the nearest point of a geometric
   grid ``(1 + grid_step)**k``: equal relative resolution for fast and slow members.
3. hysteresis: the candidate replaces the weights in force only after some member's share
   (weight / sum of weights, what the plan apportions by) has differed from its share in
   force by more than ``threshold`` (relative) for ``confirm_steps`` consecutive steps, so
   two changes of weights are at least ``confirm_steps`` steps apart.
4. drain (off unless ``drain_after`` is set): a judged member whose speed stayed below
   ``drain_below`` x the median speed for ``drain_after`` consecutive steps is suggested.

Members are the keys of each step's timings: a member missing from a step is forgotten, a
new one starts at the median weight in force (the median speed) and is judged once it has
``min_observations``. A change of members restarts the hysteresis count (the membership
change replans anyway).

What the plan asks of the caller (every micro-batch computed exactly once): every member
that plans from these weights must hold the same state, so the timings are the gathered
ones (the same bytes everywhere), every committed step is folded once and in order, and a
member that starts late (a joiner, a restarted worker) receives the state or the weights
instead of folding from scratch: either one place decides (the agents, handing the weights
down in ``Membership.weights``) or the state travels with the snapshot.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache

from keepstep.elastic.errors import BadMessage, ConfigError

__all__ = ["SpeedPolicy", "SpeedState", "StepTiming", "observe"]

# A clock cannot tell a micro-batch under a nanosecond from nothing: no information.
_MIN_SECONDS = 1e-9
# No step computes for 30 years; a bound keeps every sum and quotient finite and non-zero.
_MAX_SECONDS = 1e9
# Weights stay within this factor of the median speed either way: beyond it the plan is the
# same (the slow keep their floor of one micro-batch), and every weight stays finite.
_MAX_RATIO = 1000.0
# Observations further than this factor from their window's median are outliers.
_OUTLIER = 1.5


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"SpeedPolicy {name}={value!r} must be an int >= {low}")


def _fraction(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and 0 < value < 1)
    ):
        raise ConfigError(f"SpeedPolicy {name}={value!r} must be a number in (0, 1)")


@dataclass(frozen=True)
class SpeedPolicy:
    """The knobs of the straggler decision; validated at construction.

    ``window``: observations kept per member for its clipped mean.
    ``min_observations``: a member is judged from this many observations on.
    ``grid_step``: weights are powers of ``1 + grid_step`` (relative resolution).
    ``threshold``: relative change of a member's share that counts as moved.
    ``confirm_steps``: consecutive moved steps before the weights change.
    ``drain_below``: speed under this fraction of the median counts as too slow.
    ``drain_after``: too-slow steps in a row before a drain is suggested; None: never.

    The defaults stay still under +-20% per-step noise on every member and follow a
    3x slowdown within ``window // 2 + confirm_steps`` steps (tests/elastic/test_speed.py).
    """

    window: int = 11
    min_observations: int = 6
    grid_step: float = 0.05
    threshold: float = 0.2
    confirm_steps: int = 5
    drain_below: float = 0.25
    drain_after: int | None = None

    def __post_init__(self) -> None:
        _int_at_least("window", self.window, 1)
        _int_at_least("min_observations", self.min_observations, 1)
        _fraction("grid_step", self.grid_step)
        _fraction("threshold", self.threshold)
        _int_at_least("confirm_steps", self.confirm_steps, 1)
        _fraction("drain_below", self.drain_below)
        if self.drain_after is not None:
            _int_at_least("drain_after", self.drain_after, 1)
        if self.min_observations > self.window:
            raise ConfigError(
                f"SpeedPolicy min_observations={self.min_observations} must be <= "
                f"window={self.window}: a member is judged on the observations it keeps"
            )


@dataclass(frozen=True)
class StepTiming:
    """One member's part of one committed step, as it measured it.

    ``compute_s``: seconds spent computing its micro-batches (forward, backward, local
    accumulation), collective waits excluded. ``micro_batches``: how many it computed.
    """

    compute_s: float
    micro_batches: int

    def __post_init__(self) -> None:
        s = self.compute_s
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s <= _MAX_SECONDS:
            raise BadMessage(
                f"compute_s={s!r} must be a number of seconds in [0, {_MAX_SECONDS:g}]"
            )
        n = self.micro_batches
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise BadMessage(f"micro_batches={n!r} must be an int >= 0")

    @property
    def per_micro_batch(self) -> float | None:
        """Seconds per micro-batch, or None when the step tells nothing about speed."""
        if self.micro_batches == 0:
            return None
        seconds = self.compute_s / self.micro_batches
        return seconds if seconds >= _MIN_SECONDS else None


@dataclass(frozen=True)
class SpeedState:
    """The fold's state after the last observed step; never mutated, only replaced.

    ``weights``: the weights in force, one per member (> 0, finite), for ``plan``.
    ``replanned``: this observation changed ``weights`` for the same members (a change
    of members is replanned by the membership path and does not set it).
    ``drain``: members suggested for draining at this step, sorted.
    ``reason``: why, in words, for logs and tests.
    """

    policy: SpeedPolicy = field(default_factory=SpeedPolicy)
    step: int = -1  # the last observed step
    weights: Mapping[str, float] = field(default_factory=dict)
    recent: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # s/micro-batch
    seen: Mapping[str, int] = field(default_factory=dict)  # observations ever, per member
    pending: int = 0  # consecutive steps with some share moved beyond the threshold
    slow: Mapping[str, int] = field(default_factory=dict)  # consecutive too-slow steps
    replanned: bool = False
    drain: tuple[str, ...] = ()
    reason: str = "no step observed yet"

    def seconds_per_micro_batch(self) -> dict[str, float]:
        """The smoothed estimate of each judged member (for logs and telemetry)."""
        need = self.policy.min_observations
        return {m: _clipped_mean(xs) for m, xs in self.recent.items() if self.seen[m] >= need}


def _clipped_mean(xs: Sequence[float]) -> float:
    mid = statistics.median_low(xs)  # an observation, so it is kept: never empty
    kept = sorted(x for x in xs if mid / _OUTLIER <= x <= mid * _OUTLIER)
    total = 0.0
    for x in kept:  # ascending: the same sum whatever order the window was filled in
        total += x
    return total / len(kept)


@cache
def _grid(step: float) -> tuple[float, ...]:
    """Points ``(1 + step)**k`` within ``_MAX_RATIO`` of 1, built by exact-rounded products."""
    up, down = [1.0], [1.0]
    while up[-1] * (1.0 + step) <= _MAX_RATIO:  # the next point must stay within the bound
        up.append(up[-1] * (1.0 + step))
        down.append(down[-1] / (1.0 + step))
    return (*reversed(down[1:]), *up)


def _quantise(ratio: float, step: float) -> float:
    points = _grid(step)
    i = bisect.bisect_left(points, ratio)
    if i == 0 or i == len(points):
        return points[min(i, len(points) - 1)]
    low, high = points[i - 1], points[i]
    return low if ratio / low <= high / ratio else high  # nearer in ratio; a tie goes down


def _shares(weights: Mapping[str, float], members: list[str]) -> dict[str, float]:
    total = 0.0
    for m in members:  # sorted: the same sum on every member
        total += weights[m]
    return {m: weights[m] / total for m in members}


def _moved(
    candidate: Mapping[str, float], current: Mapping[str, float], members: list[str], limit: float
) -> list[str]:
    new, old = _shares(candidate, members), _shares(current, members)
    return [m for m in members if abs(new[m] - old[m]) > limit * old[m]]


def _check(step: object, timings: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step={step!r} must be an int >= 0")
    if not isinstance(timings, Mapping) or not timings:
        raise ConfigError(f"timings={timings!r} must be a non-empty mapping member -> StepTiming")
    for member, timing in timings.items():
        if not isinstance(member, str) or not member:
            raise ConfigError(f"member id {member!r} in timings must be a non-empty str")
        if not isinstance(timing, StepTiming):
            raise ConfigError(f"timing {timing!r} of member {member!r} must be a StepTiming")


def observe(state: SpeedState, step: int, timings: Mapping[str, StepTiming]) -> SpeedState:
    """Fold one committed ``step``'s timings (one per member of the step) into ``state``.

    Steps must come in increasing order; a step at or below the last one observed (a
    step committed again after a rollback) leaves everything but the reason as it was, so
    replaying a log is idempotent. The answer depends on the arguments only, not on the
    order of ``timings``.
    """
    _check(step, timings)
    policy = state.policy
    if step <= state.step:
        return replace(
            state,
            replanned=False,
            reason=f"step {step}: already observed (last {state.step}); nothing changes",
        )
    members = sorted(timings)

    recent: dict[str, tuple[float, ...]] = {}
    seen: dict[str, int] = {}
    for m in members:
        kept, count = state.recent.get(m, ()), state.seen.get(m, 0)
        seconds = timings[m].per_micro_batch
        if seconds is not None:
            kept, count = (*kept, seconds)[-policy.window :], count + 1
        recent[m], seen[m] = kept, count

    stay = [m for m in members if m in state.weights]
    joined = [m for m in members if m not in state.weights]
    left = sorted(m for m in state.weights if m not in timings)
    # A joiner starts at the median speed: the median weight of those who stay.
    start = 1.0
    if stay:
        start = _quantise(statistics.median(state.weights[m] for m in stay), policy.grid_step)
    current = {m: state.weights.get(m, start) for m in members}

    judged = [m for m in members if seen[m] >= policy.min_observations]
    speed = {m: 1.0 / _clipped_mean(recent[m]) for m in judged}
    median = statistics.median(speed[m] for m in judged) if judged else 1.0
    candidate = {
        m: _quantise(speed[m] / median, policy.grid_step) if m in speed else current[m]
        for m in members
    }

    moved = _moved(candidate, current, members, policy.threshold)
    # Consecutive moved steps; a change of members starts the count again.
    pending = 0
    if moved:
        pending = 1 if joined or left else state.pending + 1
    replanned = pending >= policy.confirm_steps
    weights = candidate if replanned else current

    slow = {
        m: state.slow.get(m, 0) + 1
        if len(judged) >= 2 and m in speed and speed[m] < policy.drain_below * median
        else 0
        for m in members
    }
    drain: tuple[str, ...] = ()
    if policy.drain_after is not None:
        drain = tuple(m for m in members if slow[m] >= policy.drain_after)

    words = [f"step {step}:"]
    if joined or left:
        words.append(f"members joined {joined}, left {left};")
    if replanned:
        words.append(
            f"new weights: shares of {moved} moved by more than {policy.threshold:.0%} "
            f"for {pending} steps"
        )
    elif moved:
        words.append(
            f"shares of {moved} differ by more than {policy.threshold:.0%} "
            f"({pending}/{policy.confirm_steps} steps); weights stand"
        )
    else:
        words.append(f"weights stand ({len(judged)}/{len(members)} members judged)")
    if drain:
        words[-1] += f"; drain suggested for {list(drain)} (below {policy.drain_below:g}x median)"

    return SpeedState(
        policy=policy,
        step=step,
        weights=weights,
        recent=recent,
        seen=seen,
        pending=0 if replanned else pending,
        slow=slow,
        replanned=replanned,
        drain=drain,
        reason=" ".join(words),
    )
