"""Draining a member that stays too slow: the option, and the pure decision to ask.

Where it sits: beside the speed fold (speed.py), behind `Planner` (balance.py). With
``drain_slow`` set (``keepstep.init(drain_slow="0.25:20")``, KEEPSTEP_DRAIN_SLOW,
``keepstep run --drain-slow 0.25:20``) the fold suggests a member whose speed stayed below
``below`` x the median speed for ``after`` committed steps in a row. Every member folds the
same gathered figures, so every member reaches the same suggestion at the same step;
`decide` then picks one member to ask (the slowest, ties by id), and only that member
acts: it asks its controller to drain it (`Controller.request_drain`). The node agent
takes that as a planned drain of the member's node, exactly like SIGTERM: announced, and
left at a step boundary with nothing rolled back. The agent, which knows the nodes and the
job's minimum, refuses a drain that would leave too few nodes (agent/node/slow_drain.py).

One request per member per epoch: entering an epoch starts the fold afresh, so a member
is asked again only after ``after`` more slow steps of a new epoch. Torch-free, so the
launcher's command line can check the option without importing torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.speed import SpeedState

__all__ = ["DrainRequest", "DrainSlow", "decide"]

FORM = "BELOW:STEPS, e.g. 0.25:20 (BELOW a fraction of the median speed in (0, 1), STEPS >= 1)"


@dataclass(frozen=True)
class DrainSlow:
    """Drain a member slower than ``below`` x the median speed for ``after`` steps in a row."""

    below: float = 0.25
    after: int = 20

    def __post_init__(self) -> None:
        b = self.below
        if (
            isinstance(b, bool)
            or not isinstance(b, int | float)
            or not (math.isfinite(b) and 0 < b < 1)
        ):
            raise ConfigError(f"drain_slow below={b!r} must be a number in (0, 1): {FORM}")
        a = self.after
        if isinstance(a, bool) or not isinstance(a, int) or a < 1:
            raise ConfigError(f"drain_slow after={a!r} must be an int >= 1: {FORM}")

    @classmethod
    def parse(cls, text: str) -> DrainSlow:
        """``"0.25:20"`` -> DrainSlow(0.25, 20); ConfigError naming the text otherwise."""
        below, sep, after = str(text).strip().partition(":")
        try:
            if not sep:
                raise ValueError
            return cls(float(below), int(after))
        except ValueError:
            raise ConfigError(f"drain_slow={text!r} is not {FORM}") from None

    def __str__(self) -> str:
        return f"{self.below:g}:{self.after}"


@dataclass(frozen=True)
class DrainRequest:
    """A member asks to be drained: the fold found it too slow at committed ``step``.

    ``ratio``: its speed / the median speed (smoothed, as the fold measured it)."""

    member: str
    epoch: int
    step: int
    ratio: float
    reason: str


def decide(
    state: SpeedState, epoch: int, members: Sequence[str], me: str, asked: bool
) -> tuple[DrainRequest | None, str]:
    """Whether `me` asks to be drained after the fold's last step, and why (pure).

    Only the slowest suggested member asks (ties by id), so that at most one drain is in
    flight from one suggestion; never the last member, and never twice (`asked`)."""
    if not state.drain:
        return None, "no member suggested for draining"
    seconds = state.seconds_per_micro_batch()
    speed = {m: 1.0 / s for m, s in seconds.items() if m in members}
    median = statistics.median(speed.values()) if speed else 1.0
    ratios = {m: speed[m] / median for m in state.drain if m in speed}
    if not ratios:
        return None, f"suggested {list(state.drain)} are not judged members"
    slowest = min(sorted(ratios), key=lambda m: ratios[m])
    ratio = ratios[slowest]
    if slowest != me:
        return None, f"{slowest} is the slowest suggested member ({ratio:.3f}x median)"
    if len(members) < 2:
        return None, f"{me} is the last member: never drained"
    if asked:
        return None, f"{me} asked to be drained in epoch {epoch} already"
    reason = (
        f"step {state.step}: {me} ran at {ratio:.3f}x the median speed, below "
        f"{state.policy.drain_below:g}x for {state.slow.get(me, 0)} steps in a row"
    )
    return DrainRequest(me, epoch, state.step, ratio, reason), reason
