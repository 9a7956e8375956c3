"""Step gates, the armer's side: stop the job at a fault's step, inject, let it go on.

Where it sits: `keepstep run` (`launch/injector`) and the chaos injector
(`chaos/inject`) each arm a gate in etcd for every step they have a fault at, before the
job gets there. Every node agent holds its workers at that boundary and the first one
there marks the gate held (`agent/node/gates`); `ready` hands it to the armer, which
`claim`s it, injects, and `release`s it. The job stands still meanwhile: no member can
commit the next step while one is held, so the fault lands with exactly `step` steps
committed, however short the steps are. The states and who moves them:
`protocol.GateState`.

A gate the job passed without holding (its agents could not reach etcd, it was armed
late, or an agent expired it because this side did not claim it in time) is claimed from
ARMED or EXPIRED when the armer sees the job beyond the step (`passed`), and fired late,
with the step it saw: the record says so.

This side watches its gates (one etcd watch) and wakes its owner's loop (`wake`) when one
is held, so that the hold lasts a few etcd round trips.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore, WatchEvent
from keepstep.agent.protocol import GateRecord, GateState

log = logging.getLogger(__name__)

OP_TIMEOUT_S = 5.0  # one etcd call


@dataclass(frozen=True)
class Claimed:
    """A gate this side now fires: `step` scheduled, `actual` steps committed when it
    fires, `held` whether the job stands at that boundary until `release`, `holder` the
    node whose agent held it (None if not held)."""

    name: str
    step: int
    actual: int
    held: bool
    holder: str | None = None


class GateClient:
    def __init__(self, kv: KVStore, job: str, owner: str, timeout: float = OP_TIMEOUT_S) -> None:
        """`owner` prefixes the names of this side's gates ("run", "chaos"), so that two
        armers of one job never touch each other's."""
        self.kv, self.job, self.owner, self.timeout = kv, job, owner, timeout
        self.wake = threading.Event()  # set when a gate of ours is held
        self._lock = threading.Lock()
        self._gates: dict[str, tuple[GateRecord, int]] = {}  # name -> (record, mod revision)
        self._prefix = protocol.prefix(job, protocol.GATES)
        self._cancel: Callable[[], None] | None = None

    def name(self, label: str) -> str:
        return f"{self.owner}-{label}"

    def arm(self, gates: Iterable[tuple[str, int]]) -> None:
        """Arm gates (label, step); KVError if etcd refuses. The watch starts first, so
        no agent's move is missed."""
        if self._cancel is None:
            self._cancel = self.kv.watch_prefix(self._prefix + self.owner + "-", self._seen)
        for label, step in gates:
            name = self.name(label)
            record = GateRecord(name, step, GateState.ARMED, updated_at=time.time())
            revision = self.kv.put(self._key(name), protocol.encode(record), self.timeout)
            self._note(record, revision)

    def _key(self, name: str) -> str:
        return protocol.key(self.job, protocol.GATES, name)

    def _seen(self, event: WatchEvent) -> None:
        if event.kind == "put" and event.value is not None:
            record = protocol.decode(GateRecord, event.value)
            self._note(record, event.revision)
            if record.state is GateState.HELD:
                self.wake.set()

    def _note(self, record: GateRecord, revision: int) -> None:
        with self._lock:
            known = self._gates.get(record.name)
            if known is None or known[1] < revision:
                self._gates[record.name] = (record, revision)

    def state(self, label: str) -> GateState | None:
        with self._lock:
            known = self._gates.get(self.name(label))
        return known[0].state if known is not None else None

    def ready(self) -> list[Claimed]:
        """Claim every gate an agent holds now (HELD -> FIRING); each must be released."""
        self.wake.clear()
        with self._lock:
            held = [(g, rev) for g, rev in self._gates.values() if g.state is GateState.HELD]
        out = []
        for record, revision in sorted(held, key=lambda h: h[0].step):
            if self._claim(record, revision, record.held_step):
                held_at = Claimed(record.name, record.step, record.held_step, True, record.node)
                out.append(held_at)
        return out

    def passed(self, seen_step: int) -> list[Claimed]:
        """Claim the gates not held that the job has gone past (`seen_step` steps
        committed, more than theirs): fired late, the job not held. Each must be released."""
        with self._lock:
            armed = [
                (g, rev)
                for g, rev in self._gates.values()
                if g.state in (GateState.ARMED, GateState.EXPIRED) and g.step < seen_step
            ]
        out = []
        for record, revision in sorted(armed, key=lambda a: a[0].step):
            if self._claim(record, revision, seen_step):
                out.append(Claimed(record.name, record.step, seen_step, held=False))
        return out

    def _claim(self, record: GateRecord, revision: int, actual: int) -> bool:
        firing = GateRecord(
            record.name, record.step, GateState.FIRING, record.node, actual, time.time()
        )
        try:
            won = self.kv.compare_and_put(
                self._key(record.name), protocol.encode(firing), revision, self.timeout
            )
        except KVError as error:
            log.warning("step gate %s not claimed: %s", record.name, error)
            return False
        if won:
            # Noted above the old revision at once (no second claim); the watch brings the
            # write's own revision.
            self._note(firing, revision + 1)
        else:
            self._refresh(record.name)  # moved meanwhile; the watch may lag (or have failed)
        return won

    def _refresh(self, name: str) -> None:
        try:
            found = self.kv.get(self._key(name), self.timeout)
        except KVError:
            return
        if found is not None:
            self._seen(WatchEvent("put", found.key, found.value, found.mod_revision))

    def release(self, claimed: Claimed) -> None:
        """FIRING -> RELEASED: the held workers go on. Only the claimer writes a FIRING gate,
        so the write needs no compare; an agent lets go alone if it never comes."""
        with self._lock:
            known = self._gates.get(claimed.name)
        node = known[0].node if known is not None else ""
        record = GateRecord(
            claimed.name, claimed.step, GateState.RELEASED, node, claimed.actual, time.time()
        )
        try:
            revision = self.kv.put(self._key(claimed.name), protocol.encode(record), self.timeout)
        except KVError as error:
            log.warning(
                "step gate %s not released (its agents let go alone): %s", claimed.name, error
            )
            return
        self._note(record, revision)

    def close(self) -> None:
        """Stop watching; gates still armed stay in etcd (the job's keys go with the job)."""
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
