"""The healer: answers a worker that needs the next epoch, agreeing it once, by CAS.

Three questions come from workers over the local link:

    initial   wait until an epoch admits the worker (epoch 0, or a join later)
    boundary  a planned change was announced in the last step: agree it at this boundary
    failure   a collective failed: probe the members, agree the survivors

Each decision is a pure function in `agreement`; this module observes (the job view,
the probes), applies the decision with a compare-and-set on the epoch key, names the
store the new epoch rendezvouses on and draws the epoch's secret key prefix in it (its
`token`, see `EpochRecord`), and waits until the agreed epoch is visible. Two agents
deciding at once is harmless: one write wins (with its token) and both adopt it.

Every wait has its bound in the agent's configuration: admission `admission_timeout`
(then AdmissionTimeout), the agreed epoch reaching the view `epoch_timeout` (then
EpochTimeout), a worker to admit after an epoch that lacks sharded state
`missing_state_wait` (then, as at once when every worker that could hold it is gone, the
fallback to the durable checkpoint: `fallback.py`). The agree lock covers deciding only
(observe, probe, compare-and-set, and that wait for a worker to admit), so that one
decision is made per failed epoch on this node; nobody holds it while waiting for the
epoch to appear, which would add one member's wait to the next one's.
A worker the next epoch leaves out is told so (`Excluded`) and asks to be admitted again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from keepstep.agent import protocol
from keepstep.agent.kv import KVStore, patiently
from keepstep.agent.node import agreement
from keepstep.agent.node.config import BOUNDARY_RETRY_OPS, MINORITY_WAIT_LEASES, AgentConfig
from keepstep.agent.node.fallback import Fallback
from keepstep.agent.node.probe import ProbeResult, probe_all
from keepstep.agent.node.registration import Registration
from keepstep.agent.node.view import JobView, Observed
from keepstep.agent.protocol import EpochRecord, NodeRecord, key, node_of
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.messages import (
    AdmissionTimeout,
    Excluded,
    JobCannotContinue,
    MembershipReply,
    NoChange,
)
from keepstep.agent.protocol.recovery import Cause

__all__ = ["Healer", "JobCannotContinue", "stamp"]

TOKEN_BYTES = 16  # 128 random bits: the epoch's key prefix cannot be guessed
BOUNDARY_RETRY_PAUSE_S = 0.2

log = logging.getLogger(__name__)
T = TypeVar("T")


def stamp(record: EpochRecord, nodes: Mapping[str, NodeRecord]) -> EpochRecord:
    """A proposed epoch as it is written: the store it rendezvouses on, and a fresh secret
    key prefix for everything it writes there (each epoch its own: a token that leaked
    out of an ended epoch opens nothing in the next)."""
    stamped = agreement.with_store(record, nodes)
    return replace(stamped, token=secrets.token_hex(TOKEN_BYTES))


class Healer:
    def __init__(
        self,
        cfg: AgentConfig,
        kv: KVStore,
        view: JobView,
        events: EventLog,
        registration: Registration,
        draining: Callable[[], bool],
        silent: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """`silent`: the nodes this agent's heartbeats found silent for their bound."""
        self.cfg, self.kv, self.view, self.events = cfg, kv, view, events
        self._registration, self._draining, self._silent = registration, draining, silent
        self._agree_lock = threading.Lock()
        self._decided = -1  # the newest failed epoch this agent made its decision for
        self._started = time.monotonic()
        self.fallback = Fallback(cfg)

    def membership(self, record: EpochRecord) -> MembershipReply:
        """The answer naming ``record``; for a fallback epoch, with the checkpoint file."""
        ckpt = "" if record.checkpoint_step < 0 else str(self.fallback.file_for(record))
        return MembershipReply(
            record.epoch, tuple(record.members), record.store, record.timeout_scale,
            record.token, record.checkpoint_step, ckpt,
        )  # fmt: skip

    def _agreed(
        self,
        record: EpochRecord,
        reason: str,
        previous: EpochRecord | None = None,
        **extra: Any,
    ) -> None:
        """The "epoch-agreed" event, written by the agent whose proposal won. After the
        first epoch it names the members `admitted` (joiners, restarted workers back) and
        `removed` relative to `previous`."""
        if previous is not None:
            extra["admitted"] = sorted(set(record.members) - set(previous.members))
            extra["removed"] = sorted(set(previous.members) - set(record.members))
        if record.checkpoint_step >= 0:  # a fallback: the run's summary lists it
            extra["checkpoint_step"] = record.checkpoint_step
        self.events.write(
            EventKind.EPOCH_AGREED,
            epoch=record.epoch,
            members=record.members,
            reason=reason,
            **extra,
            store=record.store,
            timeout_scale=record.timeout_scale,
        )

    def _patiently(self, what: str, call: Callable[[], T]) -> T:
        """`call`, asked again while etcd does not answer, for at most BOUNDARY_RETRY_OPS op
        timeouts in all: a worker told to give up while etcd elects a leader would restart
        from its snapshot. Only for calls that may be asked twice (puts, deletes, the
        boundary's decision)."""
        within = BOUNDARY_RETRY_OPS * self.cfg.op_timeout
        return patiently(what, call, within, BOUNDARY_RETRY_PAUSE_S)

    # -- admission ----------------------------------------------------------------------
    def admit(self, member: str) -> MembershipReply:
        """Wait until an epoch includes `member`, announcing it as pending meanwhile, at
        most `admission_timeout`. If the job ends meanwhile, the answer is an epoch without
        the worker: it leaves without training."""
        pending_key = key(self.cfg.job, "pending", member)
        # Under the node's lease (the node registers while its workers start), renewed
        # first if it expired while the node was stopped.
        if not self._registration.wait_registered(self.cfg.admission_timeout):
            raise AdmissionTimeout(
                f"{member} was not admitted within {self.cfg.admission_timeout:g} s "
                "(admission_timeout): its node did not register"
            )
        pending = protocol.encode(protocol.PendingRecord(member, time.time()))
        self._patiently(f"announce {member}", lambda: self._registration.put(pending_key, pending))
        try:
            record = self._wait_admitted(member)
        finally:
            self._patiently(
                f"withdraw {member}", lambda: self.kv.delete(pending_key, self.cfg.op_timeout)
            )
        if member not in record.members:
            return MembershipReply(record.epoch, (), "")
        return self.membership(record)

    def _wait_admitted(self, member: str) -> EpochRecord:
        """The epoch that admits `member`, or the current one once the job has finished."""
        deadline = time.monotonic() + self.cfg.admission_timeout
        view = self.view
        while True:
            with view.changed:
                cur = view.current
                if cur is not None and (member in cur.members or view.job_finished):
                    return cur
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdmissionTimeout(
                        f"{member} was not admitted within {self.cfg.admission_timeout:g} s "
                        "(admission_timeout)"
                    )
                view.changed.wait(min(left, 0.1))
            if cur is None:
                self._maybe_first_epoch()

    def _maybe_first_epoch(self) -> None:
        record, reason = agreement.first_epoch(
            self.view.observe().pending,
            self.cfg.expected_nodes * self.cfg.nproc,
            self.cfg.min_nodes * self.cfg.nproc,
            time.monotonic() - self._started,
            self.cfg.admission_grace,
            time.time(),
        )
        if record is None:
            return
        record = stamp(record, self.view.observe().nodes)
        if self.kv.create(key(self.cfg.job, "epoch"), protocol.encode(record), self.cfg.op_timeout):
            self._agreed(record, reason)

    def _settle(self, member: str, record: EpochRecord) -> MembershipReply | Excluded:
        """Answer with `record` if it includes the worker (or its node drains: the worker
        leaves); else the worker is excluded for now and asks to be admitted again."""
        if member in record.members or (self._draining() and node_of(member) == self.cfg.node):
            return self.membership(record)
        self.events.write(EventKind.EXCLUDED, member=member, epoch=record.epoch)
        return Excluded(record.epoch)

    # -- planned changes ------------------------------------------------------------------
    def boundary(self, member: str, done: int) -> MembershipReply | Excluded | NoChange:
        seen = self.view.observe()
        cur = seen.current
        assert cur is not None, "a worker at a boundary is a member of an epoch"
        decision_key = key(self.cfg.job, "boundary", f"{cur.epoch}-{done}")
        record, _ = agreement.at_boundary(cur, seen.pending, seen.leaving, done, time.time())
        if record is not None:
            record = stamp(record, seen.nodes)
        payload = protocol.encode(record) if record is not None else b"null"
        decided = self._patiently(
            f"boundary {decision_key}",
            lambda: self._decide_at_boundary(decision_key, payload, seen, done),
        )
        if decided is None:
            return NoChange()
        return self._settle(member, self.view.wait_epoch_after(cur.epoch, self.cfg.epoch_timeout))

    def _decide_at_boundary(
        self, decision_key: str, payload: bytes, seen: Observed, done: int
    ) -> EpochRecord | None:
        """The boundary's one decision, made idempotent so that it can be asked again.

        The first decision for this (epoch, step) is the only one: a late agent, whose
        view has one more joiner, must not agree a different epoch at the same boundary.
        Whoever reads a decision that changes the membership also writes its epoch
        (compare-and-set on the epoch this agent saw, so it never overwrites a newer one):
        the agent that created the decision may have died, or not heard that it did."""
        if self.kv.create(decision_key, payload, self.cfg.op_timeout):
            decided = payload
        else:
            got = self.kv.get(decision_key, self.cfg.op_timeout)
            assert got is not None, "a decision key, once created, is never deleted"
            decided = got.value
        if decided == b"null":
            return None
        record = protocol.decode(EpochRecord, decided)
        if self.kv.compare_and_put(
            key(self.cfg.job, "epoch"), decided, seen.revision, self.cfg.op_timeout
        ):
            self._agreed(record, record.reason, seen.current, planned=True, step=done)
        return record

    # -- failures ---------------------------------------------------------------------------
    def failure(
        self, member: str, epoch: int, done: int, reason: str, missing_state: bool = False
    ) -> MembershipReply | Excluded:
        with self._agree_lock:
            # One decision per failed epoch on this node: the other members whose collective
            # failed in it wait for the epoch that decision (or another agent's) agreed.
            if epoch > self._decided:
                self._decide_after_failure(epoch, done, reason, missing_state)
                self._decided = epoch
        return self._settle(member, self.view.wait_epoch_after(epoch, self.cfg.epoch_timeout))

    def _decide_after_failure(
        self, epoch: int, done: int, reason: str, missing_state: bool = False
    ) -> None:
        seen = self.view.observe()
        cur = seen.current
        assert cur is not None, "a failed worker was a member of an epoch"
        if cur.epoch > epoch:
            return  # the next epoch is agreed already (seen through the watch)
        self.events.write(
            EventKind.FAULT_DETECTED,
            cause=Cause.MISSING_STATE.value if missing_state else "collective",
            node=self.cfg.node,
            epoch=epoch,
            reason=reason,
        )
        t0 = time.monotonic()
        fallback: tuple[int, str] | None = None  # the checkpoint's step, and why
        if missing_state:
            awaited = self._await_newcomer(cur, reason)
            if awaited is None:
                return  # another agent agreed the next epoch while this one waited
            seen, fallback = awaited
        wanted = {*cur.nodes(), *(node_of(m) for m in seen.pending)}
        nodes = self._with_itself(seen.nodes)
        targets = {n: (rec.host, rec.probe_port) for n, rec in nodes.items() if n in wanted}
        probes = probe_all(targets, self.cfg.probe_timeout * cur.timeout_scale)
        again = agreement.suspects(probes, self._silent())
        if again:
            # Probed again before blamed, for as long as the lease it still holds (unless
            # its missed heartbeats were that second chance).
            longer = self.cfg.lease_ttl * cur.timeout_scale
            probes.update(probe_all({n: targets[n] for n in again}, longer))
            latest = self.view.observe()  # a hung node's lease may have expired meanwhile
            if latest.current != cur:
                return  # another agent agreed the next epoch while this one probed
            seen = latest
            probes = self._live(probes, seen)
        waited = self._unless_cut_off(cur, seen, probes)
        if waited is None:
            return  # another agent agreed the next epoch while this one waited for it
        seen, probes = waited
        record, why = agreement.after_failure(
            cur, probes, seen.pending, seen.leaving, done, time.time(), missing_state, fallback
        )
        if record is None:
            raise JobCannotContinue(f"the job cannot continue: {why}")
        record = stamp(record, self._with_itself(seen.nodes))
        if self._propose(record, seen.revision):
            self._agreed(record, why, cur, planned=False, step=done, agree_s=time.monotonic() - t0)

    def _with_itself(self, nodes: Mapping[str, NodeRecord]) -> dict[str, NodeRecord]:
        """The node records seen in etcd, and this node's own if its lease expired (it was
        cut off) and it has not registered again yet: alive, it counts itself."""
        return {self.cfg.node: self._registration.record(), **nodes}

    def _live(self, probes: Mapping[str, ProbeResult], seen: Observed) -> dict[str, ProbeResult]:
        """The probes of nodes whose leases still live, and of this node: a node whose lease
        expired is counted out as dead, but this one is running this code. (Counted out,
        once its lease went while it was cut off, it found itself in no majority ever again,
        and waited for a decision nobody was left to make.)"""
        return {n: p for n, p in probes.items() if n in seen.nodes or n == self.cfg.node}

    def _await_newcomer(
        self, cur: EpochRecord, reason: str
    ) -> tuple[Observed, tuple[int, str] | None] | None:
        """After ``cur`` failed for missing sharded state: wait until a worker from outside
        it waits to be admitted (a restarted worker, whose node kept its snapshot; a
        joiner), at most ``missing_state_wait``; then (what was seen, None). None if
        another agent agreed the next epoch meanwhile. Once no worker can bring the state
        back (every one that could hold it is gone, or the bound passed), the step of the
        durable checkpoint every member falls back to, and why (``JobCannotContinue``
        without one): never train without the state."""
        deadline = time.monotonic() + self.cfg.missing_state_wait
        dead = self._refusing(cur)
        while True:
            seen = self.view.observe()
            if seen.current != cur:
                return None
            if agreement.newcomers(cur, seen.pending, seen.leaving):
                return seen, None
            left = deadline - time.monotonic()
            live = [n for n in seen.nodes if n not in dead]
            gone = agreement.state_holders_gone(cur, live, self.cfg.nproc, seen.pending)
            if gone or left <= 0:
                why = (
                    "every worker that could hold it is gone with its node"
                    if gone
                    else f"no worker that could hold it was ready within "
                    f"{self.cfg.missing_state_wait:g} s"
                )
                lacks = f"epoch {cur.epoch} lacks sharded optimizer state ({reason}): {why}"
                return seen, (self.fallback.step_to_resume(lacks), why)
            with self.view.changed:
                self.view.changed.wait(min(left, 0.1))

    def _refusing(self, cur: EpochRecord) -> set[str]:
        """The nodes with a worker outside ``cur`` whose agent refuses the probe: gone, and
        their snapshots with them, although their leases have not expired yet."""
        seen = self.view.observe()
        outside = agreement.outside_nodes(cur, seen.nodes, self.cfg.nproc)
        targets = {n: (seen.nodes[n].host, seen.nodes[n].probe_port) for n in outside}
        probes = probe_all(targets, self.cfg.probe_timeout * cur.timeout_scale)
        return {n for n, p in probes.items() if not p.alive and not p.timed_out}

    def _propose(self, record: EpochRecord, revision: int) -> bool:
        """Compare-and-set `record` as the epoch on `revision`; whether it won. Asked again
        while etcd does not answer (a leader election: a worker told to give up would
        restart from its snapshot); a try that landed unanswered makes the next one fail,
        so then the epoch is read back: it is this proposal's if it holds its bytes (its
        creation time and token are its own)."""
        epoch_key, payload = key(self.cfg.job, "epoch"), protocol.encode(record)
        tries = 0

        def put() -> bool:
            nonlocal tries
            tries += 1
            return self.kv.compare_and_put(epoch_key, payload, revision, self.cfg.op_timeout)

        if self._patiently(f"epoch {record.epoch}", put):
            return True
        if tries == 1:
            return False  # answered: another agent's proposal won
        got = self._patiently(
            f"epoch {record.epoch} (read back)", lambda: self.kv.get(epoch_key, self.cfg.op_timeout)
        )
        return got is not None and got.value == payload

    def _unless_cut_off(
        self, cur: EpochRecord, seen: Observed, probes: dict[str, ProbeResult]
    ) -> tuple[Observed, dict[str, ProbeResult]] | None:
        """While the nodes that answered are a minority of the epoch (`agreement.minority`:
        this node may be the one cut off), wait for the others' epoch (None), or for the
        silent nodes' leases to expire, which counts them out. After MINORITY_WAIT_LEASES
        leases it still does not decide (None): the silent nodes hold leases, so they reach
        etcd, and the next epoch is theirs to agree (`failure` waits for it)."""
        why = agreement.minority(cur, probes)
        if why is None:
            return seen, probes
        log.warning("epoch %d failed: %s", cur.epoch, why)
        waited = MINORITY_WAIT_LEASES * self.cfg.lease_ttl * cur.timeout_scale
        deadline = time.monotonic() + waited
        while why is not None and time.monotonic() < deadline:
            with self.view.changed:
                self.view.changed.wait(0.1)
            seen = self.view.observe()
            if seen.current != cur:
                return None
            probes = self._live(probes, seen)
            why = agreement.minority(cur, probes)
        if why is not None:
            # Still cut off: the silent nodes kept their leases, so they reach etcd and
            # will decide (this node's own lease may have gone meanwhile). Deciding from
            # here could only remove them; this node hears their epoch when it can.
            log.warning("epoch %d: after %.1f s still %s", cur.epoch, waited, why)
            return None
        return seen, probes
