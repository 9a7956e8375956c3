"""The "weights-changed" event: the plan's weights moved within an epoch (measured speed).

Where it sits: with `balance="speed"` every member of an epoch folds the same compute
timings and replans at the same step (`keepstep.elastic.balance`); each member's commit
of that step carries the weights the plan uses from the next step on (`Commit.new_weights`).
The node agent feeds its members' commits to a `WeightsInForce` (node/reports.py), which
says once per (epoch, step) that the weights changed, from which weights to which; the
agent that hosts the step's first member writes it to its event log, so the merged logs
hold one event per change. The dashboard and the run summary read it.

The weights in force when an epoch starts are equal ones (the agents hand no weights to
their workers' plan, `Membership.weights`), as the library seeds its fold; a new epoch
starts from them again. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keepstep.agent.protocol.messages import Commit


@dataclass(frozen=True)
class WeightsChange:
    """`step`: the committed step after which the plan changes (the new weights apply from
    `step + 1`); `old`/`new`: each member's weight before and after; `counts`: the
    micro-batches each member computed at `step` (under the old weights)."""

    epoch: int
    step: int
    old: Mapping[str, float]
    new: Mapping[str, float]
    counts: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.step < 0:
            raise ValueError(f"epoch {self.epoch} and step {self.step} must be >= 0")
        if not self.new:
            raise ValueError("a weights change needs the new weights (none given)")

    def fields(self) -> dict[str, Any]:
        """The event's fields besides `t`, `kind` and `member`, as plain JSON values."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "old": dict(self.old),
            "new": dict(self.new),
            "counts": dict(self.counts),
        }


class WeightsInForce:
    """The weights each epoch's plan uses, folded from commits (one node's, any order of
    its members). `observe` returns a change once per (epoch, step) whose commit carries
    new weights; reports of an older epoch than the newest seen are ignored."""

    def __init__(self) -> None:
        self.epoch = -1
        self.weights: dict[str, float] = {}
        self.changed_at: set[int] = set()  # steps of this epoch already reported

    def observe(self, commit: Commit) -> WeightsChange | None:
        if commit.epoch < self.epoch:
            return None
        if commit.epoch > self.epoch:
            self.epoch, self.changed_at = commit.epoch, set()
            self.weights = dict.fromkeys(commit.assignment, 1.0)
        if not commit.new_weights or commit.step in self.changed_at:
            return None
        self.changed_at.add(commit.step)
        old, self.weights = self.weights, dict(commit.new_weights)
        counts = {m: len(ids) for m, ids in commit.assignment.items()}
        return WeightsChange(commit.epoch, commit.step, old, dict(commit.new_weights), counts)


def writes_change(commit: Commit, local_members: set[str] | frozenset[str]) -> bool:
    """Whether this node writes the change: it hosts the step's first member (the smallest
    id of the step's plan), so one node of the job writes each change."""
    members = sorted(commit.assignment) or [commit.member]
    return members[0] in local_members
