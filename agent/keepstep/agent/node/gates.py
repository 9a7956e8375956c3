"""Step gates, the agent's side: hold this node's workers at a gate's step boundary.

Where it sits: whoever schedules a fault at step K (`keepstep run --fault`, the chaos
injector) arms a gate in etcd (`launch/gates`); the agent's one watch of its job brings
the record here (`NodeAgent._apply`). The agent pushes the steps of the gates that are not
open to its workers (`GatesPush`); a worker that has committed such a step asks `Hold`
before its next step and gets its answer once the gate is open. The first agent whose
worker gets there marks the gate held (compare-and-set, `protocol.GateState`): the job is
then stopped at exactly that boundary (no member can commit the next step without the
held one), and the armer injects the fault and releases the gate.

Every wait is bounded: an agent that cannot mark the gate held lets its worker go at once
(nobody would know to act), and a gate held for `HOLD_TIMEOUT_S` with nobody claiming it
is expired; one being injected (FIRING) gets as long again before the agent lets go alone.
All of it stays within the worker's own bound on the answer (`hold_timeout_for`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore, WatchEvent
from keepstep.agent.protocol import GateRecord, GateState
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.link import Connection, LinkClosed
from keepstep.agent.protocol.messages import GatesPush

log = logging.getLogger(__name__)

# The armer claims a held gate within milliseconds; this long means it is gone.
HOLD_TIMEOUT_S = 10.0


def hold_timeout_for(decision: float, op_timeout: float) -> float:
    """The hold bound that keeps a whole `GateHolds.hold` (two such waits and four etcd
    calls) within `decision`, the worker's bound on the answer; `HOLD_TIMEOUT_S` at most."""
    return max(min(HOLD_TIMEOUT_S, (decision - 4 * op_timeout) / 2 * 0.9), 0.1)


def closing(gates: Iterable[GateRecord], done: int) -> list[GateRecord]:
    """The gates a worker that has committed `done` steps waits at (pure)."""
    return sorted((g for g in gates if g.closes(done)), key=lambda g: (g.step, g.name))


class GateHolds:
    def __init__(
        self,
        kv: KVStore,
        job: str,
        node: str,
        events: EventLog,
        op_timeout: float,
        hold_timeout: float = HOLD_TIMEOUT_S,
    ) -> None:
        self.kv, self.job, self.node, self.events = kv, job, node, events
        self.op_timeout, self.hold_timeout = op_timeout, hold_timeout
        self._prefix = protocol.prefix(job, protocol.GATES)
        self._changed = threading.Condition()
        self._gates: dict[str, tuple[GateRecord, int]] = {}  # name -> (record, mod revision)
        self._push_lock = threading.Lock()  # pushes go out one at a time, each the newest

    def owns(self, key: str) -> bool:
        return key.startswith(self._prefix)

    def apply(self, event: WatchEvent) -> bool:
        """Fold in a watch event of a gate's key; True if the steps workers hold at changed."""
        name = event.key[len(self._prefix) :]
        with self._changed:
            before = self.steps()
            if event.kind == "put" and event.value is not None:
                record = protocol.decode(GateRecord, event.value)
                known = self._gates.get(name)
                if known is None or known[1] < event.revision:
                    self._gates[name] = (record, event.revision)
            else:
                self._gates.pop(name, None)
            self._changed.notify_all()
            return self.steps() != before

    def steps(self) -> tuple[int, ...]:
        """The steps of the gates that are not open, sorted."""
        with self._changed:
            return tuple(sorted({g.step for g, _ in self._gates.values() if not g.state.open}))

    def push(self, conns: Iterable[Connection]) -> None:
        """Tell these workers the current steps. Under one lock, so that a worker saying
        hello and a gate changing at once cannot leave it with the older list."""
        with self._push_lock:
            message = GatesPush(self.steps())
            for conn in conns:
                try:
                    conn.send(message)
                except LinkClosed:
                    pass

    def hold(self, member: str, done: int) -> None:
        """Return once every gate at or below `done` is open (bounded: see the docstring)."""
        for gate in self._closing(done):
            if gate.state is GateState.ARMED and not self._mark_held(gate.name, member, done):
                return  # nobody learns of a hold that is not in etcd: do not hold
        if self._wait_open(done, self.hold_timeout):
            return
        self._expire(self._closing(done), member, done)
        if self._wait_open(done, self.hold_timeout):
            return
        names = [g.name for g in self._closing(done)]
        log.warning(
            "step gates %s still closed after %.0f s: going on", names, 2 * self.hold_timeout
        )
        self.events.write(EventKind.GATE_EXPIRED, gates=names, member=member, done=done, alone=True)

    def _closing(self, done: int) -> list[GateRecord]:
        with self._changed:
            return closing((g for g, _ in self._gates.values()), done)

    def _wait_open(self, done: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._closing(done):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _mark_held(self, name: str, member: str, done: int) -> bool:
        """ARMED -> HELD by this node; True if the gate is held (by this or another agent)."""
        with self._changed:
            record, revision = self._gates.get(name, (None, 0))
        if record is None or record.state is not GateState.ARMED:
            return True
        held = GateRecord(name, record.step, GateState.HELD, self.node, done, time.time())
        try:
            won = self.kv.compare_and_put(
                protocol.key(self.job, protocol.GATES, name),
                protocol.encode(held),
                revision,
                self.op_timeout,
            )
        except KVError as error:
            log.warning("step gate %s not held (etcd did not answer): %s", name, error)
            return False
        if won:
            self.events.write(
                EventKind.GATE_HELD, gate=name, step=record.step, done=done, member=member
            )
            return True
        # Another agent moved it first (held it, or its armer fired it late): wait on it.
        return self._refresh(name)

    def _refresh(self, name: str) -> bool:
        """Read the gate again (the watch may lag the compare-and-set that just lost)."""
        try:
            found = self.kv.get(protocol.key(self.job, protocol.GATES, name), self.op_timeout)
        except KVError:
            return False
        if found is not None:
            self.apply(WatchEvent("put", found.key, found.value, found.mod_revision))
        return found is not None

    def _expire(self, gates: list[GateRecord], member: str, done: int) -> None:
        """HELD -> EXPIRED for the gates nobody claimed within the bound. A gate being
        injected (FIRING) is left to its armer: the caller waits as long again for it."""
        for gate in gates:
            with self._changed:
                record, revision = self._gates.get(gate.name, (gate, 0))
            if record.state not in (GateState.ARMED, GateState.HELD):
                continue
            expired = GateRecord(
                gate.name, gate.step, GateState.EXPIRED, self.node, done, time.time()
            )
            try:
                won = self.kv.compare_and_put(
                    protocol.key(self.job, protocol.GATES, gate.name),
                    protocol.encode(expired),
                    revision,
                    self.op_timeout,
                )
            except KVError as error:
                log.warning("step gate %s not expired in etcd: %s", gate.name, error)
                continue
            if won:
                self.events.write(
                    EventKind.GATE_EXPIRED, gates=[gate.name], member=member, done=done, alone=False
                )
            self._refresh(gate.name)
