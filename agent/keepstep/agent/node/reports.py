"""What a worker's reports publish: commits, epochs entered, and its finish.

Where it sits: `node/requests` hands every Commit, Reconfigured and Finish from the link
here. Each goes to the node's event log (the run summary and the dashboard read it), and:

    Reconfigured  the member's entry into an epoch after the first, as a recovery record
                  in etcd for the operator's status (its MTTR is added at the first commit)
    Commit        the node's progress record; the recovery record again, with the MTTR, at
                  the first commit of an epoch; a durable checkpoint when one is due; a
                  "weights-changed" event when the plan's weights move (`protocol.weights`:
                  written by the node of the step's first member only)
    Finish        the member's done record (after the progress it depends on)

A commit also clears the worker's crash count (`WorkerTable.committed`): a worker that
trains again is healthy.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore
from keepstep.agent.node.config import AgentConfig, snapshot_path
from keepstep.agent.node.durable import DurableCheckpoints
from keepstep.agent.node.progress import ProgressPublisher
from keepstep.agent.node.view import JobView
from keepstep.agent.node.workers import WorkerTable
from keepstep.agent.protocol import key
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.messages import Commit, Finish, Reconfigured, encode
from keepstep.agent.protocol.weights import WeightsInForce, writes_change

log = logging.getLogger(__name__)


def record_fields(report: Commit | Reconfigured) -> dict[str, Any]:
    """A report's record as plain JSON values: its fields but the op and the member."""
    fields = encode(report)
    del fields["op"], fields["member"]
    return fields


class Reports:
    def __init__(
        self,
        cfg: AgentConfig,
        kv: KVStore,
        events: EventLog,
        view: JobView,
        workers: WorkerTable,
        progress: ProgressPublisher,
        durable: DurableCheckpoints | None,
    ) -> None:
        self.cfg, self.kv, self.events, self.view = cfg, kv, events, view
        self.workers, self.progress, self.durable = workers, progress, durable
        self.members = {protocol.member_id(cfg.node, r) for r in range(cfg.nproc)}  # this node's
        self.weights = WeightsInForce()

    def reconfigured(self, report: Reconfigured) -> None:
        record = record_fields(report)
        self.events.write(EventKind.RECONFIGURED, member=report.member, **record)
        if report.epoch > 0:
            # What this member measured entering the epoch, for the operator's status; the
            # MTTR is added at its first commit in the epoch.
            self.workers.entering(report.member, report)
            self._publish_recovery(report.member, record)

    def commit(self, report: Commit) -> None:
        record = record_fields(report)
        self.events.write(EventKind.COMMIT, member=report.member, **record)
        change = self.weights.observe(report)
        if change is not None and writes_change(report, self.members):
            self.events.write(EventKind.WEIGHTS_CHANGED, member=report.member, **change.fields())
        # Only crashes in a row count against max_restarts (a crash loop), not crashes
        # spread over a long job.
        state = self.workers.committed(report.member)
        cur = self.view.current
        first = cur.members[0] if cur is not None else None
        mttr = self.progress.record(
            record, leads=first in self.members, snapshot_bytes=self._snapshot_bytes()
        )
        entered = state.entered
        if mttr is not None and entered is not None and entered.epoch == report.epoch:
            self._publish_recovery(report.member, {**record_fields(entered), "mttr_s": mttr})
        # The epoch's first member writes the checkpoint (a sharded job: its members' parts).
        # The epoch is the one the step committed in: the view may already hold the next.
        if self.durable is not None:
            committed_in = self.view.epoch(report.epoch)
            path = snapshot_path(self.cfg, report.member)
            if committed_in is not None:
                self.durable.after_commit(path, report.step + 1, report.member, committed_in)
            else:
                log.warning(
                    "step %d of %s committed in epoch %d, which this agent never saw; its "
                    "checkpoint, if due, is left to the next one",
                    report.step + 1,
                    report.member,
                    report.epoch,
                )

    def _snapshot_bytes(self) -> int:
        """What this node's snapshot files take (one stat per local member)."""
        total = 0
        for member in self.members:
            try:
                total += snapshot_path(self.cfg, member).stat().st_size
            except OSError:  # not written yet, or removed with its worker
                continue
        return total

    def finished(self, report: Finish) -> None:
        self.events.write(
            EventKind.FINISH,
            member=report.member,
            done=report.done,
            params_sha256=report.params_sha256,
        )
        self.progress.flush()
        done = protocol.DoneRecord(report.member, report.done, report.params_sha256)
        self.kv.put(
            key(self.cfg.job, "done", report.member.replace("/", "-")),
            protocol.encode(done),
            self.cfg.op_timeout,
        )

    def _publish_recovery(self, member: str, record: dict[str, Any]) -> None:
        name = f"{record['epoch']}-{member.replace('/', '-')}"
        try:
            self.kv.put(
                key(self.cfg.job, "recoveries", name),
                json.dumps(record).encode(),
                self.cfg.op_timeout,
            )
        except KVError as error:
            log.warning("recovery record not published: %s", error)
