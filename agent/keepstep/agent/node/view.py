"""The agent's view of its job in etcd, kept current by one watch of its membership keys.

Everything the agent decides with is read from here: the agreed epoch (and the etcd
revision it was written at, for compare-and-set), the workers waiting to be admitted,
the nodes draining, the live node records, and whether any member finished. `apply`
folds one watch event in and says whether a member node of the current epoch was lost,
which is how a hang or a partition is detected without waiting for a collective, and
whether a new epoch arrived (which the agent checks against its own workers).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from keepstep.agent import protocol
from keepstep.agent.kv import WatchEvent
from keepstep.agent.protocol import EpochRecord, NodeRecord
from keepstep.errors import KeepstepError


class EpochTimeout(KeepstepError):
    """No newer epoch reached this agent's view within the bound (`wait_epoch_after`)."""


@dataclass(frozen=True)
class Observed:
    """A consistent copy of the view, taken under its lock."""

    current: EpochRecord | None
    revision: int
    pending: frozenset[str]
    leaving: frozenset[str]
    nodes: dict[str, NodeRecord]


@dataclass(frozen=True)
class Change:
    """What one watch event meant for this agent."""

    lost_node: str | None = None  # a node of the current epoch lost its lease
    lost_self: bool = False  # this node's own record vanished (its lease expired)
    new_epoch: EpochRecord | None = None  # an epoch newer than the current one arrived


RECENT_EPOCHS = 8  # epochs kept by number; a report older than these is long settled


class JobView:
    def __init__(self, job: str, node: str) -> None:
        self.job, self.node = job, node
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.current: EpochRecord | None = None
        # The latest epochs by number: a worker's report names the epoch its step committed
        # in, and may arrive after the view moved on to the next one.
        self.recent: dict[int, EpochRecord] = {}
        self.revision = 0
        self.pending: set[str] = set()
        self.leaving: set[str] = set()
        self.nodes: dict[str, NodeRecord] = {}
        self.job_finished = False  # a member trained to the end: nobody is admitted any more

    def observe(self) -> Observed:
        with self.lock:
            return Observed(
                self.current,
                self.revision,
                frozenset(self.pending),
                frozenset(self.leaving),
                dict(self.nodes),
            )

    def apply(self, event: WatchEvent) -> Change:
        rel = event.key[len(protocol.job_prefix(self.job)) :]
        kind, _, name = rel.partition("/")
        change = Change()
        if kind not in protocol.WATCHED_KINDS:  # only these are watched (protocol.py)
            return change
        with self.changed:
            if kind == "epoch" and event.kind == "put" and event.value is not None:
                record = protocol.decode(EpochRecord, event.value)
                if self.current is None or record.epoch > self.current.epoch:
                    self.current, self.revision = record, event.revision
                    self.recent[record.epoch] = record
                    for old in sorted(self.recent)[:-RECENT_EPOCHS]:
                        del self.recent[old]
                    change = Change(new_epoch=record)
                elif record.epoch == self.current.epoch:
                    self.revision = max(self.revision, event.revision)
            elif kind == "pending":
                (self.pending.add if event.kind == "put" else self.pending.discard)(name)
            elif kind == "done" and event.kind == "put":
                self.job_finished = True
            elif kind == "leaving":
                (self.leaving.add if event.kind == "put" else self.leaving.discard)(name)
            elif kind == "nodes":
                if event.kind == "put" and event.value is not None:
                    self.nodes[name] = protocol.decode(NodeRecord, event.value)
                else:
                    self.nodes.pop(name, None)
                    if name == self.node:
                        change = Change(lost_self=True)
                    elif self.current is not None and name in self.current.nodes():
                        change = Change(lost_node=name)
            self.changed.notify_all()
        return change

    def epoch(self, number: int) -> EpochRecord | None:
        """Epoch `number` if it is one of the latest this view saw, else None."""
        with self.lock:
            return self.recent.get(number)

    def change_pending(self) -> bool:
        """A planned change waits for the next boundary: a join or a drain."""
        with self.lock:
            cur = self.current
            return cur is not None and (
                any(m not in cur.members for m in self.pending)
                or any(n in cur.nodes() for n in self.leaving)
            )

    def wait_epoch_after(self, epoch: int, timeout: float) -> EpochRecord:
        """The first epoch newer than `epoch` this view holds; EpochTimeout past `timeout`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.current is None or self.current.epoch <= epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EpochTimeout(f"no epoch after {epoch} was agreed within {timeout} s")
                self.changed.wait(min(left, 0.1))
            return self.current
