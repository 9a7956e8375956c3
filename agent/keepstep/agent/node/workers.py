"""What the agent knows of each of its workers: one state per member, under one lock.

Where it sits: the supervisor's watcher threads (exits) and the link's request threads
(hello, finish, commits) both change a worker's state; `WorkerTable` applies every change
under its lock, and `WorkerState`'s transitions are pure (each returns a new state), so a
reader always sees one consistent state per worker. The agent decides with it: which
workers it offers to an epoch, how many crashes in a row a worker had, whether the node
ended well.

A worker's phases and their transitions::

    STARTING --hello--> READY --finish--> FINISHED --exit--> FINISHED (the code is kept)
        ^                 |
        |            link closes
        |                 v
        |           DISCONNECTED
        |                 |
        +--restart-- EXITED <--exit-- STARTING, READY or DISCONNECTED

    STARTING      its process runs, it has not said hello yet (importing, building)
    READY         it said hello on a link that is open: offered to epochs, told of changes
    DISCONNECTED  its link closed before its exit was seen (a crash, as a rule)
    FINISHED      it reported its finish: done, whatever its exit status turns out to be
    EXITED        its process ended without finishing; `after_exit` decides on a restart

A transition that does not apply to the phase (a hello of a process whose exit was seen
first, a link closing after a restart) leaves the state as it is. `restarts` counts the
crashes in a row: a commit clears it, so only a crash loop reaches `max_restarts`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, replace

from keepstep.agent.protocol.link import Connection
from keepstep.agent.protocol.messages import Reconfigured


class WorkerPhase(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DISCONNECTED = "disconnected"
    FINISHED = "finished"
    EXITED = "exited"


@dataclass(frozen=True)
class WorkerState:
    phase: WorkerPhase = WorkerPhase.STARTING
    conn: Connection | None = None  # its link, from its hello until it closes or it exits
    restarts: int = 0  # crashes in a row
    exit_code: int | None = None  # of its last process, once one ended
    entered: Reconfigured | None = None  # what it measured entering its newest epoch

    def hello(self, conn: Connection) -> WorkerState:
        if self.phase not in (WorkerPhase.STARTING, WorkerPhase.READY):
            return self
        return replace(self, phase=WorkerPhase.READY, conn=conn)

    def disconnected(self, conn: Connection) -> WorkerState:
        if self.conn is not conn:
            return self  # an older process's link
        phase = WorkerPhase.DISCONNECTED if self.phase is WorkerPhase.READY else self.phase
        return replace(self, phase=phase, conn=None)

    def finished(self) -> WorkerState:
        if self.phase is WorkerPhase.EXITED:
            return self
        return replace(self, phase=WorkerPhase.FINISHED)

    def exited(self, code: int) -> WorkerState:
        phase = WorkerPhase.FINISHED if self.phase is WorkerPhase.FINISHED else WorkerPhase.EXITED
        return replace(self, phase=phase, conn=None, exit_code=code)

    def restarted(self) -> WorkerState:
        if self.phase is not WorkerPhase.EXITED:
            return self
        return replace(self, phase=WorkerPhase.STARTING, restarts=self.restarts + 1)

    def committed(self) -> WorkerState:
        return replace(self, restarts=0)

    def entering(self, record: Reconfigured) -> WorkerState:
        return replace(self, entered=record)

    @property
    def ended_well(self) -> bool:
        """Finished (whatever its exit status), or left the job with status 0."""
        return self.phase is WorkerPhase.FINISHED or (
            self.phase is WorkerPhase.EXITED and self.exit_code == 0
        )


class WorkerTable:
    """The states of a node's workers, and the "change pending" flag they were told."""

    def __init__(self, members: list[str]) -> None:
        self._lock = threading.Lock()
        self._states = {m: WorkerState() for m in members}
        self._flag = False

    def __contains__(self, member: object) -> bool:
        return member in self._states  # the members are fixed: no lock needed

    def get(self, member: str) -> WorkerState:
        with self._lock:
            return self._states[member]

    def _apply(self, member: str, state: WorkerState) -> WorkerState:
        """Record `state` for `member` (the caller holds the lock)."""
        self._states[member] = state
        return state

    def hello(self, member: str, conn: Connection) -> tuple[WorkerState, bool]:
        """The worker said hello on `conn`; returns its state and the flag to push to it,
        read under the same lock as `set_flag` writes it, so no change is missed."""
        with self._lock:
            return self._apply(member, self._states[member].hello(conn)), self._flag

    def member_of(self, conn: Connection) -> str | None:
        """The member whose live link `conn` is (it said hello on it), if any."""
        with self._lock:
            for member, state in self._states.items():
                if state.conn is conn:
                    return member
        return None

    def disconnected(self, conn: Connection) -> None:
        with self._lock:
            for member, state in list(self._states.items()):
                self._apply(member, state.disconnected(conn))

    def finished(self, member: str) -> WorkerState:
        with self._lock:
            return self._apply(member, self._states[member].finished())

    def exited(self, member: str, code: int) -> WorkerState:
        with self._lock:
            return self._apply(member, self._states[member].exited(code))

    def restarted(self, member: str) -> WorkerState:
        with self._lock:
            return self._apply(member, self._states[member].restarted())

    def committed(self, member: str) -> WorkerState:
        with self._lock:
            return self._apply(member, self._states[member].committed())

    def entering(self, member: str, record: Reconfigured) -> WorkerState:
        with self._lock:
            return self._apply(member, self._states[member].entering(record))

    def ready(self) -> list[str]:
        """The members that said hello on a link that is still open, sorted."""
        with self._lock:
            return sorted(m for m, s in self._states.items() if s.phase is WorkerPhase.READY)

    def set_flag(self, flag: bool) -> list[Connection]:
        """Record the flag; the connections to push it to (none if it did not change)."""
        with self._lock:
            if flag == self._flag:
                return []
            self._flag = flag
            return [s.conn for s in self._states.values() if s.conn is not None]

    def connections(self) -> list[Connection]:
        """The open links of the workers that said hello."""
        with self._lock:
            return [s.conn for s in self._states.values() if s.conn is not None]

    def ended_well(self) -> bool:
        with self._lock:
            return all(s.ended_well for s in self._states.values())

    def exit_codes(self) -> dict[str, int | None]:
        with self._lock:
            return {m: s.exit_code for m, s in self._states.items()}
