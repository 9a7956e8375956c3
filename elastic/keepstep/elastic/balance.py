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

With `JobConfig.drain_slow` the fold also runs (with `Balance.OFF` its weights are not
used) to suggest draining a member that stays too slow; `drain_request` says whether this
member asks to be drained (slow_drain.py), once per epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from keepstep.elastic.config import Balance, JobConfig
from keepstep.elastic.control import Membership
from keepstep.elastic.plan import plan
from keepstep.elastic.slow_drain import DrainRequest, decide
from keepstep.elastic.speed import SpeedPolicy, SpeedState, StepTiming, observe

__all__ = ["Planner"]

log = logging.getLogger(__name__)


class Planner:
    """One member's copy of the plan: the same on every member of the epoch, by construction."""

    def __init__(self, config: JobConfig, policy: SpeedPolicy | None = None) -> None:
        self.config = config
        if policy is None:
            drain = config.drain_slow
            policy = SpeedPolicy()
            if drain is not None:
                policy = SpeedPolicy(drain_below=drain.below, drain_after=drain.after)
        self.policy = policy
        self.asked = False  # this member asked to be drained in this epoch
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
        self.asked = False
        self.assignment = self._plan(membership, done)
        return self.assignment

    def _plan(self, membership: Membership, done: int) -> dict[str, list[int]]:
        c = self.config
        return plan(done, membership.members, c.global_batch, c.micro_batch, self.weights)

    def committed(self, step: int, compute_s: Mapping[str, float]) -> Mapping[str, float]:
        """Fold committed `step` (every member's compute seconds, as gathered); return the
        new weights if the plan changes from step `step + 1` on, else an empty mapping."""
        folds = self.config.balance is Balance.SPEED or self.config.drain_slow is not None
        if not folds or self.membership is None:
            return {}
        counts = self.assignment
        timings = {m: StepTiming(compute_s[m], len(counts[m])) for m in sorted(counts)}
        self.speed = observe(self.speed, step, timings)
        if not self.speed.replanned or self.config.balance is Balance.OFF:
            return {}
        log.info("%s", self.speed.reason)
        self.weights = dict(self.speed.weights)
        self.assignment = self._plan(self.membership, step + 1)
        return self.weights

    def ask_drain(self, ask: Callable[[DrainRequest], None]) -> DrainRequest | None:
        """After `committed`: `ask` to drain this member if it is the one the fold found
        too slow and it has not asked in this epoch; returns the request (None: none)."""
        m = self.membership
        if self.config.drain_slow is None or m is None or not self.speed.drain:
            return None
        request, reason = decide(self.speed, m.epoch, m.members, m.me, self.asked)
        log.log(logging.DEBUG if request is None else logging.INFO, "%s", reason)
        if request is not None:
            self.asked = True
            ask(request)
        return request
