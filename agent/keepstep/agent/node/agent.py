"""The node agent: one process per node, keeping its workers in the job.

Roles, each in its own module: the job's records in etcd as one watched view (`view`),
decisions on the next epoch (`healer`, over the pure `agreement`), the store this node
hosts for process groups (`stores`), worker processes (`supervisor`) and what the agent
knows of each (`workers`), the local link to them (`link_server`) and the answers on it
(`requests`, with the reports a worker sends published by `reports`), liveness probes
(`probe`), this node's leased record (`registration`), the step gates its workers hold at
while a scheduled fault is injected (`gates`), draining it when its member stays too slow
(`slow_drain`). This module wires them, and acts on what etcd and the supervisor tell it.

Detection that does not wait for a collective to fail: a worker that exits (the
supervisor sees it at once), a neighbouring node that misses its heartbeats (`heartbeat`:
hang, partition; about 0.5 s) and a member node whose lease expired (the backstop, 1 s
and more) make the agent abort the epoch in the epoch's store, so every worker gives up its
collective within milliseconds.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstep.agent import protocol
from keepstep.agent.durable.writer import CheckpointWriter
from keepstep.agent.kv import KVError, KVStore, WatchEvent, patiently
from keepstep.agent.node import agreement
from keepstep.agent.node.config import (
    BOUNDARY_RETRY_OPS,
    AgentConfig,
    answer_bounds,
    checkpoint_cadence,
    fatal_path,
    snapshot_path,
    worker_spec,
)
from keepstep.agent.node.durable import DurableCheckpoints, resume_file
from keepstep.agent.node.gates import GateHolds, hold_timeout_for
from keepstep.agent.node.healer import Healer
from keepstep.agent.node.heartbeat import HeartbeatMonitor
from keepstep.agent.node.link_server import LinkServer, same_user_and
from keepstep.agent.node.probe import ProbeServer
from keepstep.agent.node.progress import ProgressPublisher
from keepstep.agent.node.registration import Registration
from keepstep.agent.node.reports import Reports
from keepstep.agent.node.requests import WorkerRequests
from keepstep.agent.node.slow_drain import SlowDrains
from keepstep.agent.node.spare import SparePool
from keepstep.agent.node.stores import StoreClients, StoreHost
from keepstep.agent.node.supervisor import ExitAction, Supervisor, after_exit, describe_exit
from keepstep.agent.node.view import JobView
from keepstep.agent.node.workers import WorkerPhase, WorkerTable
from keepstep.agent.protocol import EpochRecord, NodeRecord, key
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.link import LinkClosed, socket_address
from keepstep.agent.protocol.messages import PendingPush
from keepstep.errors import KeepstepError
from keepstep.fatal import read_fatal

if TYPE_CHECKING:  # OpenTelemetry's SDK is imported only when telemetry is on
    from keepstep.agent.telemetry.otel import Telemetry

log = logging.getLogger("keepstep.agent")

# How long a node whose lease expired waits between attempts to register again.
REREGISTER_RETRY_S = 1.0


class NodeAgent:
    def __init__(self, cfg: AgentConfig, kv: KVStore, telemetry: Telemetry | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.events = EventLog(
            cfg.run_dir / f"events-{cfg.node}.jsonl",
            telemetry.on_event if telemetry is not None else None,
        )
        self.lock = threading.Lock()  # guards `draining`
        self.view = JobView(cfg.job, cfg.node)
        self.workers = WorkerTable(self.members())
        self.draining = False
        self.done = threading.Event()
        self.closing = False  # workers stopped by close() are not restarted
        self.failed: str | None = None
        self.resume: Path | None = None  # the checkpoint its workers start from (--resume)
        self._cancel_watch: Callable[[], None] = lambda: None  # until `start` watches
        self.store_host = StoreHost(cfg.host, cfg.store_port, timeout=3 * cfg.op_timeout)
        # Aborts must not wait long on a dead or stopped store node.
        self.stores = StoreClients(timeout=min(cfg.op_timeout, 2.0))
        self.supervisor = Supervisor(self._on_worker_exit)
        self.spares = (
            SparePool(
                worker_spec(cfg, "", "", Path()).env,
                cfg.run_dir / f"spare-{cfg.node}.log",
                lambda pid: self.events.write(EventKind.SPARE_READY, node=cfg.node, pid=pid),
            )
            if cfg.warm_spare
            else None
        )
        self.probe_server = ProbeServer(self._status, cfg.host)
        self.registration = Registration(
            kv, key(cfg.job, "nodes", cfg.node), cfg.lease_ttl, cfg.op_timeout, self._node_record
        )
        self.heartbeat = (
            HeartbeatMonitor(
                cfg.node,
                self._heartbeat_view,
                self._heartbeat_lost,
                cfg.heartbeat_timeout,
                cfg.heartbeat_interval,
            )
            if cfg.heartbeat_timeout > 0
            else None
        )
        self.healer = Healer(
            cfg,
            kv,
            self.view,
            self.events,
            self.registration,
            lambda: self.draining,
            self.heartbeat.silent_nodes if self.heartbeat is not None else frozenset,
        )
        self.progress = ProgressPublisher(
            kv, key(cfg.job, "progress", cfg.node), cfg.node, cfg.global_batch, cfg.op_timeout
        )
        every = checkpoint_cadence(cfg)
        self.durable = (
            DurableCheckpoints(
                partial(
                    CheckpointWriter,
                    cfg.checkpoint_url or "",
                    every,
                    storage_options=cfg.storage_options,
                    after_step=cfg.resume_step,
                ),
                self.events,
                cfg.steps,
            )
            if every is not None
            else None
        )
        reports = Reports(
            cfg, kv, self.events, self.view, self.workers, self.progress, self.durable
        )
        hold = hold_timeout_for(answer_bounds(cfg).decision, cfg.op_timeout)
        self.gates = GateHolds(kv, cfg.job, cfg.node, self.events, cfg.op_timeout, hold)
        slow = SlowDrains(
            cfg.node, cfg.min_nodes, self.view, self.events, lambda: self.draining, self.drain
        )
        self.requests = WorkerRequests(
            self.workers, self.healer, reports, self.progress, self.events, self._fail, self.gates,
            slow.handle,
        )  # fmt: skip
        self.link = LinkServer(
            socket_address(cfg.job, cfg.node),
            self.requests.handle,
            self.workers.disconnected,
            admit=same_user_and(self.supervisor.owns),  # its own workers and warm spares
        )

    # -- lifecycle --------------------------------------------------------------------
    def members(self) -> list[str]:
        return [protocol.member_id(self.cfg.node, r) for r in range(self.cfg.nproc)]

    def start(self) -> None:
        job = self.cfg.job
        self._cancel_watch = self.kv.watch_prefix(
            protocol.job_prefix(job), self._apply, below=protocol.watched_below(job)
        )
        # etcd electing a leader answers nothing for seconds: a node started meanwhile (a
        # join, a replacement) asks again rather than exit, like the agents already in.
        within = BOUNDARY_RETRY_OPS * self.cfg.op_timeout
        seen = patiently(
            f"read job {job}",
            lambda: self.kv.get_prefix(protocol.job_prefix(job), self.cfg.op_timeout),
            within,
        )
        for kv in seen:
            self._apply(WatchEvent("put", kv.key, kv.value, kv.mod_revision))
        if self.cfg.resume_blob is not None:
            blob = self.cfg.resume_blob.read_bytes()
            self.resume, step = resume_file(self.cfg.run_dir, self.cfg.node, blob)
            for member in self.members():  # each starts from the checkpoint alone
                self.snapshot_path(member).unlink(missing_ok=True)
                self.events.write(EventKind.RESUMED, member=member, step=step)
        # The workers first: each takes seconds to import torch and build its model, and
        # the rest of this start runs meanwhile (hosting the store imports torch here).
        # A worker asks to be admitted only once the node has registered (`Healer.admit`).
        for member in self.members():
            self._spawn(member)
        self.store_host.serve()
        # Its record names the store and the workers' pids. A lease granted whose answer
        # was lost expires on its own.
        patiently(f"register {self.cfg.node}", self.registration.register, within)
        self.progress.start()
        if self.heartbeat is not None:
            self.heartbeat.start()
        if self.spares is not None:
            self.spares.start()
        self.events.write(
            EventKind.AGENT_STARTED,
            node=self.cfg.node,
            pid=os.getpid(),
            store=self.store_host.address,
        )

    def _node_record(self) -> NodeRecord:
        return NodeRecord(
            self.cfg.node,
            self.cfg.host,
            self.probe_server.port,
            os.getpid(),
            self.supervisor.pids(),
            time.time(),
            self.store_host.port,
        )

    def _reregister(self) -> None:
        """This node's record vanished (its lease expired while it was stopped or cut
        off): register again, retrying while etcd cannot be reached, until it closes."""
        self.events.write(EventKind.LEASE_LOST, node=self.cfg.node)
        while not self.done.is_set():
            try:
                self.registration.renew()
                return
            except KVError as error:
                log.warning("could not register again after losing the lease: %s", error)
                self.done.wait(REREGISTER_RETRY_S)

    def _spawn(self, member: str) -> None:
        """Start the member's process; its state is STARTING already (a new table, or
        `restarted`), so that its hello, however early, finds it there."""
        fatal_path(self.cfg, member).unlink(missing_ok=True)  # a predecessor's
        spec = worker_spec(
            self.cfg,
            member,
            socket_address(self.cfg.job, self.cfg.node),
            self.snapshot_path(member),
            self.resume,
        )
        spare = self.spares.take(spec.argv, spec.env, spec.log_path) if self.spares else None
        pid = self.supervisor.start(spec, spare)
        self.events.write(EventKind.WORKER_STARTED, member=member, pid=pid, warm=spare is not None)
        try:
            self.registration.publish()
        except KVError as error:
            log.warning("could not publish worker pids: %s", error)

    def snapshot_path(self, member: str) -> Path:
        return snapshot_path(self.cfg, member)

    def drain(self, cause: str = "signal") -> None:
        """Leave at the next step boundary (SIGTERM, or a member too slow): no rollback."""
        with self.lock:
            if self.draining:
                return
            self.draining = True
        self.events.write(EventKind.DRAIN_REQUESTED, node=self.cfg.node, cause=cause)
        self.kv.put(
            key(self.cfg.job, "leaving", self.cfg.node),
            protocol.encode(protocol.LeavingRecord(self.cfg.node, time.time())),
            self.cfg.op_timeout,
        )

    def _fail(self, reason: str) -> None:
        self.failed = reason

    def close(self) -> None:
        self.closing = True
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.spares is not None:
            self.spares.close()
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
        self.healer.fallback.close()
        if self.resume is not None:
            self.resume.unlink(missing_ok=True)
        self.link.close()
        self.probe_server.close()
        self.events.close()

    # -- what etcd tells us -------------------------------------------------------------
    def _apply(self, event: WatchEvent) -> None:
        if self.gates.owns(event.key):
            if self.gates.apply(event):
                self.gates.push(self.workers.connections())
            return
        before = self.view.current
        change = self.view.apply(event)
        if change.lost_self and not self.done.is_set():
            threading.Thread(target=self._reregister, daemon=True).start()
        if change.new_epoch is not None and not self.view.job_finished:
            self._check_members(change.new_epoch)
            if before is not None and agreement.superseded_unstarted(before, change.new_epoch):
                self.stores.end(before, f"superseded by epoch {change.new_epoch.epoch}")
        cur = self.view.current
        if change.lost_node is not None and cur is not None and not self.view.job_finished:
            node = change.lost_node
            self._abort(cur, "lease-expired", f"node {node} lost its lease (hung or cut off)", node)
        self._update_flag()

    def _heartbeat_view(self) -> tuple[EpochRecord | None, dict[str, NodeRecord]]:
        seen = self.view.observe()
        if self.view.job_finished or self.closing:
            return None, {}
        return seen.current, seen.nodes

    def _heartbeat_lost(self, epoch: EpochRecord, node: str, silent_s: float) -> None:
        cur = self.view.current
        if cur is None or cur.epoch != epoch.epoch or self.view.job_finished or self.closing:
            return  # that epoch is over already (or the job is)
        reason = f"node {node} missed its heartbeats for {silent_s:.2f} s (hung or cut off)"
        self._abort(cur, "heartbeat-missed", reason, node)

    def _check_members(self, epoch: EpochRecord) -> None:
        """End an epoch that names a worker of this node that is not running and ready
        (see `agreement.not_offered`): nobody would answer for it in the rendezvous."""
        gone = agreement.not_offered(epoch, self.cfg.node, self._offered())
        if gone:
            reason = f"epoch {epoch.epoch} names {','.join(gone)}, not running on {self.cfg.node}"
            self._abort(epoch, "worker-exit", reason, self.cfg.node)

    def _offered(self) -> list[str]:
        """The workers this node offers to an epoch: ready (they said hello) and alive."""
        return [m for m in self.workers.ready() if self.supervisor.alive(m)]

    def _update_flag(self) -> None:
        flag = self.view.change_pending()
        for conn in self.workers.set_flag(flag):
            try:
                conn.send(PendingPush(flag))
            except LinkClosed:
                pass

    def _abort(self, epoch: EpochRecord, cause: str, reason: str, node: str) -> None:
        self.events.write(
            EventKind.FAULT_DETECTED, cause=cause, node=node, epoch=epoch.epoch, reason=reason
        )
        self.progress.fault(epoch.epoch)
        self.stores.end(epoch, reason)

    # -- workers ----------------------------------------------------------------------
    def _status(self) -> dict[str, Any]:
        return {"node": self.cfg.node, "ready": self._offered(), "draining": self.draining}

    def _on_worker_exit(self, member: str, pid: int, code: int) -> None:
        state = self.workers.exited(member, code)
        if self.closing:
            return
        finished = state.phase is WorkerPhase.FINISHED
        self.events.write(
            EventKind.WORKER_EXITED, member=member, pid=pid, code=code, finished=finished
        )
        cur = self.view.current
        refused = None if finished or code == 0 else read_fatal(fatal_path(self.cfg, member))
        decision = after_exit(
            member,
            code,
            finished=finished,
            in_epoch=cur is not None and member in cur.members,
            draining=self.draining,
            restarts=state.restarts,
            max_restarts=self.cfg.max_restarts,
            refused=refused,
        )
        if finished and code != 0:
            self.events.write(
                EventKind.WORKER_ABNORMAL_EXIT,
                member=member,
                pid=pid,
                code=code,
                exit=describe_exit(code),
                reason=decision.reason,
            )
        if decision.abort and cur is not None:
            self._abort(cur, "worker-exit", f"worker {member} exited with {code}", self.cfg.node)
        if decision.action is ExitAction.RESTART:
            self.workers.restarted(member)
            self._spawn(member)
            return
        if decision.action is ExitAction.GIVE_UP:
            self.failed = decision.reason
        if self.supervisor.running() == 0:
            self.done.set()
