"""The epoch's micro-batch plan, and its replans from measured speed (``balance="speed"``).

Where it sits: `Job` asks a `Planner` for the plan when it enters an epoch
(`enter`) and hands it every committed step's gathered compute seconds (`committed`).
With `Balance.SPEED` those are folded into a `SpeedState` (speed.py); when the fold
changes the weights, the plan from the next step on follows them: a slow member gets
fewer micro-batches. The switch happens at a step boundary, needs no rollback and no
collective of its own: the figures rode on the gradient's sum (step.py), so every
member folds the same bytes in the same order and replans at the same step. The numbers
do not change, because nothing depends on which member computes a micro-batch.

Why the state lives for one epoch: every member of an epoch must hold the same state,
and a joiner or a restarted worker has none. Entering an epoch (after a failure or a
planned change) starts every member from the same empty state, seeded with the weights
the controller gave (`Membership.weights`) or equal ones; a joiner needs nothing, and a
rolled-back step folded again is folded by a fresh state. The rule between the two
sources of weights: the controller's stand until the fold replans within the epoch; from
then on the fold's do (it measured the controller's as the weights in force, so a share
moves only when the measured speed says so).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from keepstep.elastic.config import Balance, JobConfig
from keepstep.elastic.control import Membership
from keepstep.elastic.plan import plan
from keepstep.elastic.speed import SpeedPolicy, SpeedState, StepTiming, observe

__all__ = ["Planner"]

log = logging.getLogger(__name__)


class Planner:
    """One member's copy of the plan: the same on every member of the epoch, by construction."""

    def __init__(self, config: JobConfig, policy: SpeedPolicy | None = None) -> None:
        self.config = config
        self.policy = SpeedPolicy() if policy is None else policy
        self.membership: Membership | None = None
        self.weights: Mapping[str, float] | None = None  # what the current plan apportions by
        self.assignment: dict[str, list[int]] = {}
        self.speed = SpeedState(self.policy)

    def check(self, membership: Membership, done: int) -> None:
        """ConfigError now if the batch cannot be split over `membership` (before any
        rendezvous)."""
        c = self.config
        plan(done, membership.members, c.global_batch, c.micro_batch, membership.weights)

    def enter(self, membership: Membership, done: int) -> dict[str, list[int]]:
        """Start the epoch's plan at step `done`, and an empty speed state."""
        self.membership, self.weights = membership, membership.weights
        seed = dict(membership.weights or dict.fromkeys(membership.members, 1.0))
        self.speed = SpeedState(self.policy, weights=seed)
        self.assignment = self._plan(membership, done)
        return self.assignment

    def _plan(self, membership: Membership, done: int) -> dict[str, list[int]]:
        c = self.config
        return plan(done, membership.members, c.global_batch, c.micro_batch, self.weights)

    def committed(self, step: int, compute_s: Mapping[str, float]) -> Mapping[str, float]:
        """Fold committed `step` (every member's compute seconds, as gathered); return the
        new weights if the plan changes from step `step + 1` on, else an empty mapping."""
        if self.config.balance is Balance.OFF or self.membership is None:
            return {}
        counts = self.assignment
        timings = {m: StepTiming(compute_s[m], len(counts[m])) for m in sorted(counts)}
        self.speed = observe(self.speed, step, timings)
        if not self.speed.replanned:
            return {}
        log.info("%s", self.speed.reason)
        self.weights = dict(self.speed.weights)
        self.assignment = self._plan(self.membership, step + 1)
        return self.weights
