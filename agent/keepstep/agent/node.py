"""The node agent: one process per node, keeping its workers in the job.

Roles, each in its own module: membership records in etcd (`kv`, `protocol`), worker
processes (`supervisor`), the local link to them (`link`), liveness probes (`probe`),
membership decisions (`agreement`). This module wires them and answers the workers:

    initial   wait until an epoch admits the worker (epoch 0, or a join later)
    boundary  a planned change was announced in the last step: agree it, once, by CAS
    failure   a collective failed: probe the members, agree the survivors by CAS
    commit    progress and the per-step ledger, to the event log and etcd

Detection that does not wait for a collective to fail: a worker that exits (the
supervisor sees it at once) and a member node whose lease expired (hang, partition)
make the agent abort the epoch in the process-group store, so every worker gives up
its collective within milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import TCPStore

from keepstep.agent import agreement, protocol
from keepstep.agent.agent_config import AgentConfig, snapshot_path, worker_spec
from keepstep.agent.checkpoint import CheckpointWriter
from keepstep.agent.durable import DurableCheckpoints, seed_snapshot
from keepstep.agent.events import EventLog
from keepstep.agent.kv import KVError, KVStore, WatchEvent
from keepstep.agent.link import Connection, LinkClosed, LinkServer, Message, socket_address
from keepstep.agent.probe import ProbeServer, probe_all
from keepstep.agent.progress import ProgressPublisher
from keepstep.agent.protocol import EpochRecord, NodeRecord, key, node_of
from keepstep.agent.registration import Registration
from keepstep.agent.supervisor import Supervisor
from keepstep.elastic.comm import abort_epoch
from keepstep.elastic.errors import KeepstepError

log = logging.getLogger("keepstep.agent")


class NodeAgent:
    def __init__(self, cfg: AgentConfig, kv: KVStore) -> None:
        self.cfg = cfg
        self.kv = kv
        self.events = EventLog(cfg.run_dir / f"events-{cfg.node}.jsonl")
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.agree_lock = threading.Lock()
        self.current: EpochRecord | None = None
        self.current_rev = 0
        self.pending: set[str] = set()
        self.leaving: set[str] = set()
        self.nodes: dict[str, NodeRecord] = {}
        self.ready: dict[str, Connection] = {}
        self.flag = False
        self.job_finished = False  # a member trained to the end: nobody is admitted any more
        self.draining = False
        self.exit_codes: dict[str, int] = {}
        self.finished: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.started = time.monotonic()
        self.done = threading.Event()
        self.failed: str | None = None
        host, _, port = cfg.store.rpartition(":")
        try:
            self.store = TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=3 * cfg.op_timeout)
            )
        except RuntimeError as error:  # torch's DistNetworkError is a RuntimeError
            raise KeepstepError(
                f"cannot reach the process-group store at {cfg.store}: {error}"
            ) from None
        self.supervisor = Supervisor(self._on_worker_exit)
        self.probe_server = ProbeServer(self._status, cfg.host)
        self.registration = Registration(
            kv, key(cfg.job, "nodes", cfg.node), cfg.lease_ttl, cfg.op_timeout, self._node_record
        )
        self.link = LinkServer(socket_address(cfg.job, cfg.node), self._handle, self._on_disconnect)
        self.progress = ProgressPublisher(
            kv,
            key(cfg.job, "progress", cfg.node),
            cfg.node,
            int(cfg.worker_env.get("KEEPSTEP_GLOBAL_BATCH", "0")),
            cfg.op_timeout,
        )
        self.durable = (
            DurableCheckpoints(
                CheckpointWriter(
                    cfg.checkpoint_url,
                    cfg.checkpoint_every or max(cfg.steps, 1),
                    storage_options=cfg.storage_options,
                    after_step=cfg.resume_step,
                ),
                self.events,
                cfg.steps,
            )
            if cfg.checkpoint_url
            else None
        )

    # -- lifecycle --------------------------------------------------------------------
    def members(self) -> list[str]:
        return [protocol.member_id(self.cfg.node, r) for r in range(self.cfg.nproc)]

    def start(self) -> None:
        job = self.cfg.job
        self._cancel_watch = self.kv.watch_prefix(protocol.job_prefix(job), self._on_watch)
        for kv in self.kv.get_prefix(protocol.job_prefix(job), self.cfg.op_timeout):
            self._apply(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
        self.registration.register()
        self.progress.start()
        if self.cfg.resume_blob is not None:
            blob = self.cfg.resume_blob.read_bytes()
            for member in self.members():
                seed_snapshot(self.snapshot_path(member), blob, self.events, member)
        for member in self.members():
            self._spawn(member)
        self.events.write("agent-started", node=self.cfg.node, pid=os.getpid())

    def _node_record(self) -> NodeRecord:
        return NodeRecord(
            self.cfg.node,
            self.cfg.host,
            self.probe_server.port,
            os.getpid(),
            self.supervisor.pids(),
            time.time(),
        )

    def _reregister(self) -> None:
        self.events.write("lease-lost", node=self.cfg.node)
        self.registration.renew()

    def _spawn(self, member: str) -> None:
        spec = worker_spec(
            self.cfg,
            member,
            socket_address(self.cfg.job, self.cfg.node),
            self.snapshot_path(member),
        )
        pid = self.supervisor.start(spec)
        self.events.write("worker-started", member=member, pid=pid)
        try:
            self.registration.publish()
        except KVError as error:
            log.warning("could not publish worker pids: %s", error)

    def snapshot_path(self, member: str) -> Path:
        return snapshot_path(self.cfg, member)

    def drain(self) -> None:
        """Leave at the next step boundary (SIGTERM): nothing is rolled back."""
        with self.lock:
            if self.draining:
                return
            self.draining = True
        self.events.write("drain-requested", node=self.cfg.node)
        self.kv.put(
            key(self.cfg.job, "leaving", self.cfg.node),
            protocol.encode(protocol.LeavingRecord(self.cfg.node, time.time())),
            self.cfg.op_timeout,
        )

    def close(self) -> None:
        self.supervisor.stop_all(timeout=5.0)
        self.progress.stop()
        if self.durable is not None:
            try:
                self.durable.close(timeout=60.0)
            except KeepstepError as error:
                self.failed = f"durable checkpoint failed: {error}"
        self.registration.stop()
        self._cancel_watch()
        try:
            self.kv.delete(key(self.cfg.job, "nodes", self.cfg.node), self.cfg.op_timeout)
            self.kv.delete(key(self.cfg.job, "leaving", self.cfg.node), self.cfg.op_timeout)
            for member in self.members():
                self.kv.delete(key(self.cfg.job, "pending", member), self.cfg.op_timeout)
        except KVError as error:
            log.warning("could not remove this node's keys: %s", error)
        for member in self.members():
            self.snapshot_path(member).unlink(missing_ok=True)
        self.link.close()
        self.probe_server.close()
        self.events.close()

    # -- what etcd tells us -------------------------------------------------------------
    def _on_watch(self, event: WatchEvent) -> None:
        self._apply(event)

    def _apply(self, event: WatchEvent) -> None:
        rel = event.key[len(protocol.job_prefix(self.cfg.job)) :]
        kind, _, name = rel.partition("/")
        abort: EpochRecord | None = None
        with self.changed:
            if kind == "epoch" and event.kind == "put" and event.value is not None:
                record = protocol.decode(EpochRecord, event.value)
                if self.current is None or record.epoch > self.current.epoch:
                    self.current, self.current_rev = record, event.revision
                elif record.epoch == self.current.epoch:
                    self.current_rev = max(self.current_rev, event.revision)
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
                    if name == self.cfg.node and not self.done.is_set():
                        threading.Thread(target=self._reregister, daemon=True).start()
                    elif self.current is not None and name in self.current.nodes():
                        abort = self.current
            self.changed.notify_all()
        if abort is not None and name != self.cfg.node and not self.job_finished:
            self._abort(
                abort, "lease-expired", f"node {name} lost its lease (hung or cut off)", name
            )
        self._update_flag()

    def _update_flag(self) -> None:
        with self.lock:
            cur = self.current
            flag = cur is not None and (
                any(m not in cur.members for m in self.pending)
                or any(n in cur.nodes() for n in self.leaving)
            )
            if flag == self.flag:
                return
            self.flag = flag
            conns = list(self.ready.values())
        for conn in conns:
            try:
                conn.send({"op": "pending", "value": flag})
            except LinkClosed:
                pass

    def _abort(self, epoch: EpochRecord, cause: str, reason: str, node: str) -> None:
        self.events.write(
            "fault-detected", cause=cause, node=node, epoch=epoch.epoch, reason=reason
        )
        abort_epoch(self.store, epoch.epoch, reason)

    # -- workers ----------------------------------------------------------------------
    def _status(self) -> dict[str, Any]:
        with self.lock:
            members = sorted(self.ready)
        ready = [m for m in members if self.supervisor.alive(m)]
        return {"node": self.cfg.node, "ready": ready, "draining": self.draining}

    def _on_disconnect(self, conn: Connection) -> None:
        with self.lock:
            for member, c in list(self.ready.items()):
                if c is conn:
                    del self.ready[member]

    def _on_worker_exit(self, member: str, pid: int, code: int) -> None:
        self.events.write("worker-exited", member=member, pid=pid, code=code)
        with self.lock:
            self.ready.pop(member, None)
            self.exit_codes[member] = code
            cur = self.current
        if code == 0:
            self.finished.add(member)
        else:
            if cur is not None and member in cur.members:
                self._abort(
                    cur, "worker-exit", f"worker {member} exited with {code}", self.cfg.node
                )
            count = self.restarts.get(member, 0)
            if not self.draining and count < self.cfg.max_restarts:
                self.restarts[member] = count + 1
                self._spawn(member)
                return
            self.failed = f"worker {member} exited with {code} after {count} restarts"
        if self.supervisor.running() == 0:
            self.done.set()

    def _handle(self, conn: Connection, message: Message) -> Message | None:
        op = message.get("op")
        member = str(message.get("member", ""))
        if op == "hello":
            with self.lock:
                self.ready[member] = conn
                flag = self.flag
            conn.send({"op": "pending", "value": flag})
            return {"ok": True}
        if op == "initial":
            return self._admit(member)
        if op == "boundary":
            return self._boundary(member, int(message["done"]))
        if op == "failure":
            return self._failure(
                member, int(message["epoch"]), int(message["done"]), str(message.get("reason", ""))
            )
        if op in ("commit", "reconfigured"):
            record = message["record"]
            self.events.write(op, member=member, **record)
            if op == "commit":
                # A worker that trains again is healthy: only crashes in a row count
                # against max_restarts (a crash loop), not crashes spread over a long job.
                self.restarts.pop(member, None)
                self.progress.record(record)
                cur = self.current
                # One writer per job: the first worker of the epoch's first node.
                if self.durable is not None and cur is not None and cur.members[0] == member:
                    self.durable.after_commit(self.snapshot_path(member), int(record["step"]) + 1)
            elif int(record["epoch"]) > 0:
                # What this member measured entering the epoch, for the operator's status.
                self._publish(f"{record['epoch']}-{member.replace('/', '-')}", record)
            return None
        if op == "finish":
            self.events.write(
                "finish",
                member=member,
                done=message["done"],
                params_sha256=message["params_sha256"],
            )
            done = protocol.DoneRecord(member, int(message["done"]), str(message["params_sha256"]))
            self.kv.put(
                key(self.cfg.job, "done", member.replace("/", "-")),
                protocol.encode(done),
                self.cfg.op_timeout,
            )
            return {"ok": True}
        raise KeepstepError(f"unknown link operation {op!r}")

    # -- admission, planned changes, failures -----------------------------------------------
    def _publish(self, name: str, record: dict[str, Any]) -> None:
        try:
            self.kv.put(
                key(self.cfg.job, "recoveries", name),
                json.dumps(record).encode(),
                self.cfg.op_timeout,
            )
        except KVError as error:
            log.warning("recovery record not published: %s", error)

    def _membership(self, record: EpochRecord) -> Message:
        return {"membership": {"epoch": record.epoch, "members": record.members}}

    def _admit(self, member: str) -> Message:
        """Block until an epoch includes `member` (announcing it as pending meanwhile)."""
        pending_key = key(self.cfg.job, "pending", member)
        self.kv.put(
            pending_key,
            protocol.encode(protocol.PendingRecord(member, time.time())),
            self.cfg.op_timeout,
            lease=self.registration.lease,
        )
        while True:
            with self.changed:
                cur = self.current
                if cur is not None and member in cur.members:
                    break
                if cur is not None and self.job_finished:
                    # The job ended while this worker waited: it leaves without training.
                    self.kv.delete(pending_key, self.cfg.op_timeout)
                    return {"membership": {"epoch": cur.epoch, "members": []}}
                self.changed.wait(0.1)
            if cur is None:
                self._maybe_first_epoch()
        self.kv.delete(pending_key, self.cfg.op_timeout)
        return self._membership(cur)

    def _maybe_first_epoch(self) -> None:
        with self.lock:
            pending = set(self.pending)
        record, reason = agreement.first_epoch(
            pending,
            self.cfg.expected_nodes * self.cfg.nproc,
            self.cfg.min_nodes * self.cfg.nproc,
            time.monotonic() - self.started,
            self.cfg.admission_grace,
            time.time(),
        )
        if record is not None and self.kv.create(
            key(self.cfg.job, "epoch"), protocol.encode(record), self.cfg.op_timeout
        ):
            self.events.write("epoch-agreed", epoch=0, members=record.members, reason=reason)

    def _wait_epoch_after(self, epoch: int, timeout: float) -> EpochRecord:
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.current is None or self.current.epoch <= epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KeepstepError(f"no epoch after {epoch} was agreed within {timeout} s")
                self.changed.wait(min(left, 0.1))
            return self.current

    def _settle(self, member: str, record: EpochRecord) -> Message:
        """Answer with `record` if it includes the worker (or the node drains); else wait."""
        if member in record.members or (self.draining and node_of(member) == self.cfg.node):
            return self._membership(record)
        self.events.write("excluded", member=member, epoch=record.epoch)
        return self._admit(member)

    def _boundary(self, member: str, done: int) -> Message:
        with self.lock:
            cur = self.current
            pending, leaving = set(self.pending), set(self.leaving)
            rev = self.current_rev
        assert cur is not None
        decision_key = key(self.cfg.job, "boundary", f"{cur.epoch}-{done}")
        record, reason = agreement.at_boundary(cur, pending, leaving, done, time.time())
        payload = protocol.encode(record) if record is not None else b"null"
        if self.kv.create(decision_key, payload, self.cfg.op_timeout):
            if record is not None and self.kv.compare_and_put(
                key(self.cfg.job, "epoch"), payload, rev, self.cfg.op_timeout
            ):
                self.events.write(
                    "epoch-agreed",
                    epoch=record.epoch,
                    members=record.members,
                    reason=reason,
                    planned=True,
                    step=done,
                )
        else:
            got = self.kv.get(decision_key, self.cfg.op_timeout)
            assert got is not None
            record = None if got.value == b"null" else protocol.decode(EpochRecord, got.value)
        if record is None:
            return {"membership": None}
        return self._settle(member, self._wait_epoch_after(cur.epoch, self.cfg.admission_grace))

    def _failure(self, member: str, epoch: int, done: int, reason: str) -> Message:
        with self.agree_lock:
            with self.lock:
                cur = self.current
                rev = self.current_rev
                pending, leaving = set(self.pending), set(self.leaving)
                nodes = dict(self.nodes)
            assert cur is not None
            if cur.epoch <= epoch:
                self.events.write(
                    "fault-detected",
                    cause="collective",
                    node=self.cfg.node,
                    epoch=epoch,
                    reason=reason,
                )
                t0 = time.monotonic()
                targets = {
                    n: (rec.host, rec.probe_port)
                    for n, rec in nodes.items()
                    if n in {*cur.nodes(), *(node_of(m) for m in pending)}
                }
                probes = probe_all(targets, self.cfg.probe_timeout)
                record, why = agreement.after_failure(
                    cur, probes, pending, leaving, done, time.time()
                )
                if record is None:
                    self.failed = why
                    raise KeepstepError(f"the job cannot continue: {why}")
                if self.kv.compare_and_put(
                    key(self.cfg.job, "epoch"), protocol.encode(record), rev, self.cfg.op_timeout
                ):
                    self.events.write(
                        "epoch-agreed",
                        epoch=record.epoch,
                        members=record.members,
                        reason=why,
                        planned=False,
                        step=done,
                        agree_s=time.monotonic() - t0,
                    )
            new = self._wait_epoch_after(epoch, self.cfg.admission_grace)
        return self._settle(member, new)


def run_agent(cfg: AgentConfig, kv: KVStore) -> int:
    """Run until every worker has finished (0), or the job cannot go on (1)."""
    agent = NodeAgent(cfg, kv)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=agent.drain).start())
    agent.start()
    try:
        agent.done.wait()
    finally:
        agent.close()
    codes = agent.exit_codes
    ok = all(codes.get(m) == 0 for m in agent.members()) and agent.failed is None
    if not ok:
        print(f"keepstep agent {cfg.node}: {agent.failed or codes}", file=sys.stderr)
    return 0 if ok else 1
