"""The agent's answers to its workers, dispatched on the type of each link message.

Where it sits: `node/link_server` decodes a worker's message and calls `handle` on a
thread of its own (so a request that waits never holds up another). What each does:

    Hello          the worker is ready: offered to epochs from now, and told whether a
                   planned change is pending and which step gates are closed
    Initial        the healer admits it (waits until an epoch includes it, bounded)
    Boundary       the healer agrees the planned change announced in the last step
    Failure        the healer agrees the survivors of a failed epoch
    Finish         the worker is done, whatever its exit status turns out to be
    Hold           the worker reached a closed step gate: answered once it is open
                   (`node/gates`, bounded)
    Commit, Reconfigured   reports, published by `node/reports`; not answered
    SlowDrain      the worker's member stayed too slow: `on_slow_drain` drains the node
                   if the job can spare it (`node/slow_drain`); not answered

The answers are typed replies; an error raised here reaches the worker as its type
(`link_server` turns it into an ErrorReply).

A connection speaks for one worker: the member it said hello as. Anything else on it (a
message before its hello, one naming another member, a second hello as another member, a
hello as a member whose live worker holds another connection) is refused, so one worker's
process cannot report, fail or finish in another's name.
"""

from __future__ import annotations

from collections.abc import Callable

from keepstep.agent.node.gates import GateHolds
from keepstep.agent.node.healer import Healer
from keepstep.agent.node.progress import ProgressPublisher
from keepstep.agent.node.reports import Reports
from keepstep.agent.node.workers import WorkerTable
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.link import Connection
from keepstep.agent.protocol.messages import (
    BadMessage,
    Boundary,
    Commit,
    Failure,
    Finish,
    Hello,
    Hold,
    Initial,
    JobCannotContinue,
    Message,
    Ok,
    PendingPush,
    Push,
    Reconfigured,
    Reply,
    SlowDrain,
)


class WorkerRequests:
    def __init__(
        self,
        workers: WorkerTable,
        healer: Healer,
        reports: Reports,
        progress: ProgressPublisher,
        events: EventLog,
        on_fatal: Callable[[str], None],
        gates: GateHolds | None = None,
        on_slow_drain: Callable[[SlowDrain], None] | None = None,
    ) -> None:
        """`on_fatal(reason)` is told when the job cannot go on (the agent then fails);
        `gates`: the step gates (None: none are ever armed, as in unit tests);
        `on_slow_drain`: acts on a worker's request to drain its node (None: ignored)."""
        self.workers, self.healer, self.reports = workers, healer, reports
        self.progress, self.events, self.on_fatal = progress, events, on_fatal
        self.gates, self.on_slow_drain = gates, on_slow_drain

    def handle(self, conn: Connection, message: Message) -> Reply | None:
        if isinstance(message, Reply | Push):
            raise BadMessage("op", f"{message.OP.value!r} is not a worker's message")
        if message.member not in self.workers:
            raise BadMessage("member", f"{message.member!r} is not a worker of this node")
        self._check_speaker(conn, message)
        match message:
            case Hello():
                # The worker imported everything and built its model: it can be admitted.
                self.events.write(EventKind.WORKER_READY, member=message.member)
                _, pending = self.workers.hello(message.member, conn)
                conn.send(PendingPush(pending))
                if self.gates is not None:
                    # Pushed before the answer: the worker knows its gates before it trains.
                    self.gates.push([conn])
                return Ok()
            case Initial():
                return self.healer.admit(message.member)
            case Boundary():
                return self.healer.boundary(message.member, message.done)
            case Failure():
                self.progress.fault(message.epoch)
                try:
                    return self.healer.failure(
                        message.member,
                        message.epoch,
                        message.done,
                        message.reason,
                        missing_state=message.missing_state,
                    )
                except JobCannotContinue as error:
                    self.on_fatal(str(error))
                    raise
            case Hold():
                if self.gates is not None:
                    self.gates.hold(message.member, message.done)
                return Ok()
            case Finish():
                # From here on the worker is done, whatever its exit status turns out to be.
                self.workers.finished(message.member)
                self.reports.finished(message)
                return Ok()
            case Commit():
                self.reports.commit(message)
                return None
            case Reconfigured():
                self.reports.reconfigured(message)
                return None
            case SlowDrain():
                if self.on_slow_drain is not None:
                    self.on_slow_drain(message)
                return None

    def _check_speaker(self, conn: Connection, message: Message) -> None:
        """BadMessage unless `conn` may speak for `message.member` (see the docstring)."""
        member = message.member  # type: ignore[union-attr]  # every worker message names one
        said = self.workers.member_of(conn)
        if isinstance(message, Hello):
            if said is not None and said != member:
                raise BadMessage(
                    "member", f"this connection said hello as {said!r}, not {member!r}"
                )
            held = self.workers.get(member).conn
            if held is not None and held is not conn:
                raise BadMessage(
                    "member", f"{member!r} is connected already, on another connection"
                )
            return
        if said != member:
            why = "said no hello" if said is None else f"said hello as {said!r}"
            raise BadMessage("member", f"{member!r}: this connection {why}")
