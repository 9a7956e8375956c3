"""The chaos injector: fires the faults `keepstep run` does not inject itself.

Where it sits: `runner.py` starts `keepstep run` (which injects the step-triggered kills,
hangs, drains and joins itself) and one `Injector` thread beside it. The injector polls
the run directory (`rundir.RunView`) and, when a fault is due, acts from outside on the
run's processes (`actions.py`, and `keepstep.launch.cgroups`). A fault at a step lands at
that step: the agents hold the job at that boundary on a step gate (`step_gates.py`) while
the injector acts (a kill of etcd or a partition releases the gate first: the release
travels through etcd; no further step can commit before they land). Without gates (no etcd
access, as in cluster mode) a step fault is due when the event logs show its step: a step
or more late.

    kill-worker, kill-node, hang-node, drain-node   by time, or during a recovery
    slow-node          a CPU quota in a cgroup, or a SIGSTOP/SIGCONT duty cycle
    corrupt-snapshot   flip bytes in the worker's newest snapshot slot, then kill it
    kill-etcd          SIGKILL the run's etcd, or of three members the leader (and start
                       it again after restart_after)
    partition-node     take the node's veth down for `duration` (a `--netns` run only)

A node it hung without a resume time stays stopped until every other node has ended,
then it is killed (as the launcher does with its own hangs). `finish` undoes whatever
still lasts once the run is over. Each fault yields one record for the report, with the
step it landed at and, for a step fault, the step it was scheduled at.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keepstep.chaos import actions
from keepstep.chaos.model import Fault, FaultKind
from keepstep.chaos.rundir import RunView, alive, children_matching, process_group
from keepstep.chaos.step_gates import InjectorGates
from keepstep.errors import KeepstepError
from keepstep.launch import cgroups, netns
from keepstep.launch.gates import Claimed

log = logging.getLogger("keepstep.chaos")

# Faults that cut the injector off from the agents' etcd: the gate is released first.
_RELEASE_FIRST = frozenset({FaultKind.KILL_ETCD, FaultKind.PARTITION_NODE})


@dataclass
class Applied:
    """What the injector (or the launcher) did for one fault of the run's list."""

    index: int
    kind: str
    node: str | None
    spec: str
    via: str
    t: float | None = None
    step: int | None = None  # steps the job had committed when it landed
    skipped: str | None = None
    scheduled_step: int | None = None  # a step fault's step
    held: bool | None = None  # a step fault: the job stood at its boundary meanwhile
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Injector(threading.Thread):
    def __init__(
        self,
        run_dir: Path,
        launcher_pid: int | None,
        faults: tuple[tuple[int, Fault], ...],
        skip: dict[FaultKind, str],
        poll_s: float = 0.02,
        ip: str | None = "ip",
    ) -> None:
        super().__init__(name="chaos-injector", daemon=True)
        self.ip = shutil.which(ip) if ip else None  # for partitions (None: there is none)
        self.view = RunView(run_dir)
        self.run_dir = run_dir
        self.launcher_pid = launcher_pid
        self.pending = list(faults)
        self.skip = skip
        self.poll_s = poll_s
        self.records: dict[int, Applied] = {}
        self.etcd_pids: list[int] = []
        self._etcd_found = False
        self.cgroups: list[cgroups.Cgroup] = []
        self._ongoing: list[tuple[float, actions.Ongoing]] = []  # (end time, action)
        self._hung: dict[str, actions.Held] = {}  # stopped until the others end
        self._etcd_restart: tuple[float, list[str], str] | None = None
        self._restarted: list[actions.RestartedEtcd] = []
        self._halt = threading.Event()
        self._lock = threading.RLock()  # _apply runs under it and takes it again
        self.error: BaseException | None = None
        self.gates = InjectorGates()  # armed once the agents' etcd can be reached

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._tick()
                # A held gate wakes the loop at once: the job stands still until it acts.
                (self.gates.wake or self._halt).wait(self.poll_s)
        except BaseException as error:  # the runner reports it; the run still gets cleaned
            log.exception("chaos injector failed")
            self.error = error

    def _tick(self) -> None:
        self.view.poll()
        if not self._etcd_found and self.launcher_pid is not None:
            # The members of a cluster start one after another: look until training runs.
            found = children_matching(self.launcher_pid, str(self.run_dir / "etcd"))
            self.etcd_pids += [pid for pid in found if pid not in self.etcd_pids]
            self._etcd_found = bool(self.etcd_pids) and self.view.first_commit_t is not None
        self.gates.arm(
            self.view, [(i, f.at.step) for i, f in self.pending if f.at.step is not None]
        )
        self._fire_gated()
        now = time.time()
        for index, fault in list(self.pending):
            due = self._due(index, fault, now)
            if due:
                self.pending.remove((index, fault))
                with self._lock:
                    self.records[index] = self._apply(index, fault, self.view.step)
        with self._lock:
            for end_t, action in list(self._ongoing):
                if now >= end_t:
                    self._ongoing.remove((end_t, action))
                    try:
                        action.end()
                    except (OSError, KeepstepError) as error:
                        # What could not be undone, the leftover check reports.
                        log.warning("chaos: could not undo %r: %s", action, error)
        if self._etcd_restart is not None and now >= self._etcd_restart[0]:
            _, argv, cwd = self._etcd_restart
            self._etcd_restart = None
            etcd = actions.RestartedEtcd(argv, cwd, self.run_dir / "etcd" / "restarted.log")
            self._restarted.append(etcd)
            self.etcd_pids.append(etcd.proc.pid)
        self._end_hung_when_alone()

    def _due(self, index: int, fault: Fault, now: float) -> bool:
        at = fault.at
        if at.step is not None:
            return index not in self.gates.gated and self.view.step >= at.step
        if at.time is not None:
            start = self.view.first_commit_t
            return start is not None and now - start >= at.time
        ref = self.records.get(at.during_recovery_of or 0)
        if ref is None:
            return False
        if ref.skipped is not None or ref.t is None:
            return True  # _apply records the skip
        noticed = [t for t in self.view.detections if t >= ref.t]
        return bool(noticed) and now >= min(noticed) + at.delay

    def _end_hung_when_alone(self) -> None:
        if not self._hung or self.view.finished == 0:
            return
        others = [pid for node, pid in self.view.agents.items() if node not in self._hung]
        if not any(alive(pid) for pid in others):
            for stopped in self._hung.values():
                stopped.kill()
            self._hung.clear()

    # -- applying one fault ----------------------------------------------------------------
    def node_name(self, index: int) -> str:
        """The name a scenario's node `index` has in the run (its agent's node id)."""
        return f"n{index}"

    def _fire_gated(self) -> None:
        """Act on the gates the agents hold (and, late, on those the job passed unheld)."""
        for index, claimed in self.gates.claims(self.view.step):
            fault = next((f for i, f in self.pending if i == index), None)
            if fault is None:  # handled already: let the job go on
                self.gates.release(claimed)
                continue
            self.pending.remove((index, fault))
            with self._lock:
                self.records[index] = self._apply(index, fault, claimed.actual, claimed)

    def _apply(
        self, index: int, fault: Fault, step: int, claimed: Claimed | None = None
    ) -> Applied:
        """Apply one fault with `step` steps committed; `claimed`: the gate that holds the
        job for it, released here (before acting on etcd's reach, else after)."""
        node = self.node_name(fault.node) if fault.node is not None else None
        rec = Applied(index, fault.kind.value, node, str(fault), "injector", step=step)
        rec.scheduled_step = fault.at.step
        rec.held = claimed.held if claimed else None if fault.at.step is None else False
        first = claimed is not None and fault.kind in _RELEASE_FIRST
        try:
            if claimed is not None and first:
                self.gates.release(claimed)
            self._act_recorded(fault, node, rec)
        finally:
            if claimed is not None and not first:
                self.gates.release(claimed)
        return rec

    def _act_recorded(self, fault: Fault, node: str | None, rec: Applied) -> None:
        ref = fault.at.during_recovery_of
        if fault.kind in self.skip:
            rec.skipped = self.skip[fault.kind]
        elif ref is not None and self.records[ref].skipped is not None:
            rec.skipped = f"it was to land in the recovery from fault #{ref}, which was skipped"
        else:
            rec.t = time.time()
            try:
                rec.skipped = self._act(fault, node, rec.detail)
            except (OSError, KeepstepError, ValueError) as error:
                rec.skipped = f"could not apply: {error!r}"
        if rec.skipped is not None:
            rec.t = None
            log.warning("chaos: fault %s skipped: %s", fault, rec.skipped)

    def _act(self, fault: Fault, node: str | None, detail: dict[str, Any]) -> str | None:
        """Apply a fault; return why it could not be applied, or None."""
        kind = fault.kind
        if kind is FaultKind.KILL_ETCD:
            return self._kill_etcd(fault, detail)
        assert node is not None
        agent = self.view.agents.get(node)
        if agent is None or not alive(agent):
            return f"node {node} is not running"
        if kind in (FaultKind.KILL_WORKER, FaultKind.CORRUPT_SNAPSHOT):
            worker = self.view.worker_pid(node)
            if worker is None or not alive(worker):
                return f"node {node} has no live worker now"
            detail["pid"] = worker
            if kind is FaultKind.CORRUPT_SNAPSHOT:
                return self._corrupt(fault, node, worker, detail)
            actions.send(worker, signal.SIGKILL)
        elif kind is FaultKind.KILL_NODE:
            actions.send(agent, signal.SIGKILL, group=True)
        elif kind is FaultKind.DRAIN_NODE:
            actions.send(agent, signal.SIGTERM)
        elif kind is FaultKind.HANG_NODE:
            self._hang(fault, node, agent, detail)
        elif kind is FaultKind.SLOW_NODE:
            self._slow(fault, node, agent, detail)
        elif kind is FaultKind.PARTITION_NODE:
            return self._partition(fault, node, detail)
        else:
            return f"{kind.value} cannot be injected by the local injector"
        return None

    def _hang(self, fault: Fault, node: str, agent: int, detail: dict[str, Any]) -> None:
        freezer = None
        if fault.method == "freezer":
            freezer = cgroups.Cgroup.create("freezer", self._group_name(node), agent)
            self.cgroups.append(freezer)
            freezer.add(process_group(agent))
            freezer.freeze(True)
        else:
            actions.send(agent, signal.SIGSTOP, group=True)
        stopped = actions.Stopped(agent, freezer)
        detail["method"] = "freezer" if freezer else "signal"
        with self._lock:
            if fault.duration is not None:
                self._ongoing.append((time.time() + fault.duration, stopped))
                detail["resume_after_s"] = fault.duration
            else:
                self._hung[node] = stopped

    def _slow(self, fault: Fault, node: str, agent: int, detail: dict[str, Any]) -> None:
        assert fault.duration is not None
        action: actions.Ongoing
        reason = None
        if fault.method in (None, "auto", "cgroup"):
            try:
                group = cgroups.Cgroup.create("cpu", self._group_name(node), agent)
                self.cgroups.append(group)
                group.limit_cpu(fault.cpu)
                group.add(process_group(agent))
                action = actions.Throttled(group)
                detail["method"] = "cgroup"
            except (cgroups.CgroupUnavailable, OSError) as error:
                if fault.method == "cgroup":
                    raise OSError(f"cgroup cpu throttle unavailable: {error}") from None
                reason = str(error)
        if fault.method == "signal" or reason is not None:
            action = actions.DutyCycle(agent, fault.cpu)
            detail["method"] = "signal"
            if reason:
                detail["cgroup_unavailable"] = reason
        detail["cpu_share"] = fault.cpu
        with self._lock:
            self._ongoing.append((time.time() + fault.duration, action))

    def _partition(self, fault: Fault, node: str, detail: dict[str, Any]) -> str | None:
        assert fault.duration is not None  # the scenario model requires one
        loaded = netns.load_plan(self.run_dir)
        if loaded is None or self.ip is None:
            return "the run's nodes have no network namespaces (keepstep run --netns)"
        plan, indices = loaded
        index = int(node.removeprefix("n"))
        if index not in indices:
            return f"node {node} has no network namespace"
        net = plan.node(index)
        cut = actions.Partitioned(self.ip, net.host_veth)
        detail.update(
            method="veth-down",
            veth=net.host_veth,
            address=net.address,
            resume_after_s=fault.duration,
        )
        with self._lock:
            self._ongoing.append((time.time() + fault.duration, cut))
        return None

    def snapshot_path(self, node: str) -> Path | None:
        """The shared-memory snapshot of the node's first worker (None: not known yet)."""
        job = self.view.job_id(node)
        if job is None:
            return None
        return self.view.snapshot_dir(node) / f"keepstep-{job}-{node}-0"

    def _corrupt(self, fault: Fault, node: str, worker: int, detail: dict[str, Any]) -> str | None:
        path = self.snapshot_path(node)
        if path is None:
            return f"node {node} has no agent configuration yet"
        # Stopped while its snapshot is changed, so no copy of its own races the flip.
        actions.send(worker, signal.SIGSTOP)
        try:
            detail.update(actions.corrupt_newest_slot(path))
        finally:
            actions.send(worker, signal.SIGKILL if fault.kill else signal.SIGCONT)
            if fault.kill:
                actions.send(worker, signal.SIGCONT)
        detail["snapshot"] = path.name
        detail["killed"] = fault.kill
        if not detail.get("corrupted"):
            return f"snapshot {path.name}: {detail.get('reason')}"
        return None

    def _kill_etcd(self, fault: Fault, detail: dict[str, Any]) -> str | None:
        live = [pid for pid in self.etcd_pids if alive(pid)]
        if not live:
            return "the run's etcd is not running"
        victim, why = actions.etcd_victim([actions.etcd_member(pid) for pid in live])
        argv, cwd = actions.etcd_command(victim.pid)
        actions.send(victim.pid, signal.SIGKILL)
        detail.update(pid=victim.pid, member=victim.name, leader=victim.leader, chosen=why)
        if fault.restart_after is not None:
            self._etcd_restart = (time.time() + fault.restart_after, argv, cwd)
            detail["restart_after_s"] = fault.restart_after
        return None

    def _group_name(self, node: str) -> str:
        return f"keepstep-chaos-{os.getpid()}-{node}-{len(self.cgroups)}"

    # -- the end ------------------------------------------------------------------------
    def finish(self, timeout: float = 10.0) -> list[Applied]:
        """Stop the loop, undo what still lasts, and return one record per fault handled
        (faults never due get a record saying so)."""
        self._halt.set()
        self.join(timeout)
        with self._lock:
            for _, action in self._ongoing:
                try:
                    action.end()
                except (OSError, KeepstepError) as error:
                    log.warning("chaos: could not undo %r: %s", action, error)
            self._ongoing.clear()
            for stopped in self._hung.values():
                stopped.kill()
            self._hung.clear()
            # Every group made, whatever became of its fault (an end that failed, a
            # fallback after the group was made): what is still there after this is a leak.
            for group in self.cgroups:
                try:
                    group.release()
                except (OSError, KeepstepError) as error:
                    log.warning("chaos: could not remove cgroup %s: %s", group.path, error)
        for etcd in self._restarted:
            etcd.end()
        self.gates.close()
        for index, fault in self.pending:
            node = self.node_name(fault.node) if fault.node is not None else None
            self.records[index] = Applied(
                index,
                fault.kind.value,
                node,
                str(fault),
                "injector",
                skipped=f"never due: the run ended before {fault.at}",
                scheduled_step=fault.at.step,
            )
        self.pending.clear()
        return [self.records[i] for i in sorted(self.records)]
