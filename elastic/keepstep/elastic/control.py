"""The boundary between a training process and whoever decides membership.

The library never decides who is in the job: a `Controller` tells it. The node agent
implements one over its local link; tests and `keepstep selfcheck` use `ScheduleController`,
which replays membership changes fixed in advance. Everything the library measures about a
membership change comes back through `on_reconfigured` as a `Reconfiguration` record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from torch._C._distributed_c10d import Store

from keepstep.elastic.errors import ConfigError, PeerLost
from keepstep.elastic.slow_drain import DrainRequest


@dataclass(frozen=True)
class Fallback:
    """The epoch resumes every member from the job's durable checkpoint of ``step``, which
    its agent wrote as one exported snapshot to ``path``: the sharded state the last
    epoch lacked was lost with every holder (a double fault)."""

    step: int
    path: str

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"fallback step={self.step!r} must be an int >= 0")
        if not self.path:
            raise ConfigError("a fallback needs the path of its checkpoint, got ''")


@dataclass(frozen=True)
class Membership:
    """One membership epoch as seen by one member: who trains, and who I am."""

    epoch: int
    members: tuple[str, ...]
    me: str
    weights: Mapping[str, float] | None = None
    # The epoch's store and collective timeouts, as a multiple of their defaults: raised by
    # the agents after an epoch that ended while nothing was lost (a loaded machine).
    timeout_scale: float = 1.0
    fallback: Fallback | None = None  # resume from the durable checkpoint, not snapshots

    def __post_init__(self) -> None:
        if self.epoch < 0:
            raise ConfigError(f"epoch={self.epoch} must be >= 0")
        if not (math.isfinite(self.timeout_scale) and self.timeout_scale >= 1.0):
            raise ConfigError(f"timeout_scale={self.timeout_scale} must be a number >= 1")
        if list(self.members) != sorted(set(self.members)):
            raise ConfigError(f"members={list(self.members)} must be sorted and unique")

    @property
    def includes_me(self) -> bool:
        return self.me in self.members


@dataclass(frozen=True)
class Reconfiguration:
    """What the library measured while entering an epoch (seconds).

    `resume_step` is the committed step every member rolled back to (the minimum over
    members that held state); `rolled_back_steps` is how many committed steps this member
    threw away; `received_state` says whether the state came from a peer over the network.
    `stepped_elements`: with sharded optimizer state, how many of its elements this member
    steps and holds in the epoch (None: full replicas, all of them); `reshard_s`: the part
    of `restore_s` spent moving and cutting that state into the epoch's shards;
    `reshard_bytes`: the bytes of it this member received from peers.
    """

    epoch: int
    members: tuple[str, ...]
    communicator_s: float
    restore_s: float
    replan_s: float
    resume_step: int
    rolled_back_steps: int
    received_state: bool
    stepped_elements: int | None = None
    reshard_s: float = 0.0
    reshard_bytes: int = 0


@dataclass(frozen=True)
class CommitRecord:
    """A committed step: which micro-batches and samples this member contributed.

    `assignment` is the whole epoch's plan for the step. A step commits only after every
    member reduced all of its micro-batches, so any one member's record accounts for the
    whole global batch (a member killed right after committing cannot report its own).
    `compute_s`: this member's seconds computing its micro-batches (step.py says what
    counts). `new_weights`: set only on a step after which the plan changes within the
    epoch (measured speed, balance.py): the weights the plan uses from the next step on.
    """

    step: int
    epoch: int
    world_size: int
    micro_batches: tuple[int, ...]
    samples: tuple[int, ...]
    step_s: float
    assignment: Mapping[str, Sequence[int]] = field(default_factory=dict)
    snapshot_s: float = 0.0  # the snapshot's share of step_s (the copy overlaps the next)
    skipped: bool = False  # committed without an optimizer step (loss scaling overflowed)
    metrics: Mapping[str, float] = field(default_factory=dict)  # step.log, reduced
    compute_s: float = 0.0
    new_weights: Mapping[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0  # this process's CPU seconds over step_s, every thread's


class Controller(Protocol):
    """Decides membership; the training process asks it at step boundaries and on failure."""

    def store(self, epoch: int) -> Store:
        """The store that epoch ``epoch``'s process group rendezvouses on (under its own
        prefix). It may differ between epochs: agents host it on a node of the epoch, so
        losing a node never takes the store of the epochs after it away."""
        ...

    def initial(self, timeout: float) -> Membership:
        """The first epoch this process takes part in (blocks until it is admitted)."""
        ...

    def change_pending(self) -> bool:
        """True while this member's side has a planned change (drain, join) to announce.

        Members OR their flags in every step's commit, so all of them learn of a change
        in the same step and switch at the same boundary.
        """
        ...

    def poll(self, done: int, announced: bool) -> Membership | None:
        """The membership that starts at this step boundary, if it changes here.

        `announced` says whether any member flagged a change in the step just committed;
        a controller may block (bounded) until that change is agreed.
        """
        ...

    def on_failure(self, epoch: int, done: int, error: PeerLost, timeout: float) -> Membership:
        """Block until the next epoch is agreed after a failed step; return it."""
        ...

    def on_reconfigured(self, record: Reconfiguration) -> None: ...

    def on_commit(self, record: CommitRecord) -> None: ...

    def request_drain(self, request: DrainRequest) -> None:
        """This member stays too slow (slow_drain.py): drain it, as a planned change, if
        whoever decides membership allows it. Must not block the step for long."""
        ...

    def on_finish(self, done: int, params_sha256: str) -> None: ...


@dataclass
class ScheduleController:
    """Membership fixed in advance: `schedule[k]` is epoch k's sorted member list.

    `at_step[k]` is the step boundary at which epoch k starts as a planned change (drain,
    join), or None for an epoch entered only when a step of the epoch before it fails (the
    scheduled survivors of a crash). A process started later (a joiner) names the epoch it
    enters as `first_epoch`. `timeout_scale` raises every epoch's store and collective
    timeouts (`Membership.timeout_scale`), for schedules whose churn a loaded machine
    makes slow. Used by tests, `keepstep selfcheck` and the local launcher; the node agent
    replaces it.
    """

    store_: Store
    me: str
    schedule: Sequence[Sequence[str]]
    at_step: Sequence[int | None] = (0,)
    first_epoch: int = 0
    result_path: Path | None = None
    timeout_scale: float = 1.0
    reconfigurations: list[Reconfiguration] = field(default_factory=list)
    commits: list[CommitRecord] = field(default_factory=list)
    drain_requests: list[DrainRequest] = field(default_factory=list)
    _epoch: int = 0

    def __post_init__(self) -> None:
        if len(self.schedule) != len(self.at_step):
            raise ConfigError(
                f"schedule has {len(self.schedule)} epochs but at_step has {len(self.at_step)}"
            )
        planned = [s for s in self.at_step if s is not None]
        if self.at_step[0] != 0 or planned != sorted(planned):
            raise ConfigError(f"at_step={list(self.at_step)} must start at 0 and not decrease")
        if not 0 <= self.first_epoch < len(self.schedule):
            raise ConfigError(f"first_epoch={self.first_epoch} is not an epoch of the schedule")
        if self.me not in self.schedule[self.first_epoch]:
            raise ConfigError(f"member {self.me!r} is not in epoch {self.first_epoch}")
        if not (math.isfinite(self.timeout_scale) and self.timeout_scale >= 1.0):
            raise ConfigError(f"timeout_scale={self.timeout_scale} must be a number >= 1")

    def _membership(self, epoch: int) -> Membership:
        self._epoch = epoch
        # Tell members that join in this epoch that the others are on their way.
        self.store_.set(f"keepstep/schedule/epoch-{epoch}", "open")
        members = tuple(sorted(self.schedule[epoch]))
        return Membership(epoch, members, self.me, timeout_scale=self.timeout_scale)

    def store(self, epoch: int) -> Store:
        return self.store_

    def initial(self, timeout: float) -> Membership:
        if self.first_epoch > 0:
            # A joiner waits (long: the job may be many steps from its boundary) until the
            # members reach the epoch it is admitted in.
            key = f"keepstep/schedule/epoch-{self.first_epoch}"
            self.store_.wait([key], timedelta(seconds=max(timeout, 600.0)))
        return self._membership(self.first_epoch)

    def change_pending(self) -> bool:
        return self._boundary(self._epoch + 1) is not None

    def _boundary(self, epoch: int) -> int | None:
        return self.at_step[epoch] if epoch < len(self.schedule) else None

    def poll(self, done: int, announced: bool) -> Membership | None:
        nxt = self._epoch + 1
        if nxt < len(self.schedule):
            boundary = self.at_step[nxt]
            if boundary is not None and boundary <= done:
                return self._membership(nxt)
        return None

    def on_failure(self, epoch: int, done: int, error: PeerLost, timeout: float) -> Membership:
        nxt = epoch + 1
        if nxt >= len(self.schedule):
            raise error
        return self._membership(nxt)

    def on_reconfigured(self, record: Reconfiguration) -> None:
        self.reconfigurations.append(record)

    def on_commit(self, record: CommitRecord) -> None:
        self.commits.append(record)

    def request_drain(self, request: DrainRequest) -> None:
        # The schedule is fixed in advance: the request is recorded, never acted on.
        self.drain_requests.append(request)

    def on_finish(self, done: int, params_sha256: str) -> None:
        if self.result_path is None:
            return
        result = {
            "member": self.me,
            "steps": done,
            "params_sha256": params_sha256,
            "world_size_by_step": {str(c.step): c.world_size for c in self.commits},
            "micro_batches_by_step": {str(c.step): len(c.micro_batches) for c in self.commits},
            "new_weights_by_step": {
                str(c.step): dict(c.new_weights) for c in self.commits if c.new_weights
            },
            "step_seconds": [c.step_s for c in self.commits],
            "step_cpu_seconds": [c.cpu_s for c in self.commits],
            "drain_requests": [r.__dict__ for r in self.drain_requests],
            # A step committed again after a rollback: its last commit is the one that stands.
            "metrics_by_step": {str(c.step): dict(c.metrics) for c in self.commits if c.metrics},
            "samples": [s for c in self.commits for s in c.samples],
            "reconfigurations": [
                r.__dict__ | {"members": list(r.members)} for r in self.reconfigurations
            ],
        }
        self.result_path.write_text(json.dumps(result))
