"""The chaos harness's Ray target: each run is `keepstep run --backend ray` on a local
multi-raylet Ray cluster that the target starts and stops.

Where it sits: `keepstep chaos run SCENARIO --target ray` (`keepstep.chaos.cli`, which
imports this module only then) hands `runner.run_scenario` a `RayTarget`; the fault-free
reference is the same job run by the local target (the numbers are the same by design,
and it is cached). The target starts a `localcluster.LocalRayCluster` when the first run
needs it; for each run it sizes the cluster to one raylet per node the job starts with,
runs the Ray launcher (`cli.run`) in this process, the cluster's driver, with the run's
faults as step-gated `RayFault`s, and then reads what the run left: its run directory
holds the events and summary.json of `keepstep run`, so every invariant is checked as
for the local target. `close` stops the cluster and returns what of it was left.

    kill-node                    the node's actor dies (SIGKILL), its agent and workers too
    kill-node, method: ray-node  the node's Ray node is removed (its raylet and every
                                 process on it); a fresh raylet takes its place, as an
                                 autoscaler replaces a lost machine, and the launcher
                                 places a replacement actor there
    kill-worker                  the node's actor SIGKILLs its first worker (restarted)
    join-node                    a raylet is added; the job, started with --nnodes up to
                                 its nodes plus joins, grows onto it

Faults fire at a step only (the launcher's step gates); one at a time or inside a
recovery is skipped, with the reason, as are the kinds of `unsupported`.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from keepstep.agent.protocol.events import read_events
from keepstep.chaos.inject import Applied
from keepstep.chaos.invariants import Observation
from keepstep.chaos.model import Fault, FaultKind, Job
from keepstep.chaos.rundir import CHECKPOINTS, RunView, alive, command_line
from keepstep.chaos.schedule import RunPlan
from keepstep.chaos.target import RunOutcome
from keepstep.errors import KeepstepError
from keepstep.launch.run_config import RunConfig
from keepstep.raylaunch.cli import run as run_on_ray
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind
from keepstep.raylaunch.localcluster import NODE_RESOURCE, LocalRayCluster, processes_with

UNSUPPORTED = {
    FaultKind.HANG_NODE: "Ray cannot stop an actor's processes and resume them: hang-node "
    "is the local target's (SIGSTOP or a cgroup freezer on the node's processes)",
    FaultKind.DRAIN_NODE: "an agent that exits 0 tells the Ray launcher the job has finished, "
    "so a node cannot leave mid-run: drain-node is the local and cluster targets'",
    FaultKind.SLOW_NODE: "Ray has no control over an actor's CPU share: slow-node is the "
    "local target's (a cgroup quota or a SIGSTOP duty cycle)",
    FaultKind.CORRUPT_SNAPSHOT: "flipping bytes in a node's shared-memory snapshot is the "
    "local injector's, not something done through Ray",
    FaultKind.KILL_ETCD: "the Ray launcher's etcd runs in the driver's process tree: "
    "kill-etcd is the local target's",
    FaultKind.PARTITION_NODE: "the raylets of a local Ray cluster share this machine's "
    "network: partition-node needs the local target's network namespaces",
    FaultKind.RESTART_OPERATOR: "a Ray run has no operator: restart-operator is the "
    "cluster target's",
}
BY_STEP_ONLY = "the Ray target injects faults at a step only (the Ray launcher's step gates)"
_POLL_S = 0.5  # the run directory is read this often while the job runs (checkpoints)
_LEFT_TIMEOUT_S = 15.0  # a run's processes are gone within this after the launcher returns


@dataclass(frozen=True)
class Mapped:
    """The Ray faults of one plan, and a record per fault (skipped ones say why)."""

    faults: tuple[RayFault, ...]
    records: tuple[Applied, ...]
    joins: int


def map_faults(plan: RunPlan | None) -> Mapped:
    """The plan's faults as Ray faults; a fault that cannot be one is recorded skipped.
    Pure: what each scenario fault becomes on Ray."""
    faults: list[RayFault] = []
    records: list[Applied] = []
    joins = 0
    for index, fault in enumerate(plan.faults if plan is not None else ()):
        node = None if fault.node is None else f"n{fault.node}"
        rec = Applied(index, fault.kind.value, node, str(fault), "ray-launcher")
        rec.scheduled_step = fault.at.step
        kind = _ray_kind(fault)
        if fault.kind in UNSUPPORTED:
            rec.skipped = UNSUPPORTED[fault.kind]
        elif fault.at.step is None:
            rec.skipped = BY_STEP_ONLY
        elif kind is None:
            rec.skipped = f"{fault.kind.value} has no Ray form"
        else:
            faults.append(RayFault(kind, fault.node, fault.at.step))
            rec.detail["ray"] = str(faults[-1])
            joins += kind is RayFaultKind.ADD_NODE
        records.append(rec)
    return Mapped(tuple(faults), tuple(records), joins)


def _ray_kind(fault: Fault) -> RayFaultKind | None:
    if fault.kind is FaultKind.KILL_NODE:
        return RayFaultKind.REMOVE_NODE if fault.method == "ray-node" else RayFaultKind.KILL_ACTOR
    return {
        FaultKind.KILL_WORKER: RayFaultKind.KILL_WORKER,
        FaultKind.JOIN_NODE: RayFaultKind.ADD_NODE,
    }.get(fault.kind)


class RayTarget:
    """`etcd_binary`: the etcd each run's launcher starts (the command line finds it)."""

    name = "ray"

    def __init__(self, etcd_binary: str) -> None:
        self.etcd_binary = etcd_binary
        self.started: LocalRayCluster | None = None

    @property
    def cluster(self) -> LocalRayCluster:
        if self.started is None:
            self.started = LocalRayCluster()
        return self.started

    def unsupported(self) -> dict[FaultKind, str]:
        return dict(UNSUPPORTED)

    def close(self) -> list[str]:
        """Stop the cluster (if one was started); what of it was still there."""
        cluster, self.started = self.started, None
        return cluster.stop() if cluster is not None else []

    def run_config(self, job: Job, joins: int, run_dir: Path) -> RunConfig:
        """`keepstep run`'s configuration of the job, as the local target's command line
        gives it; up to `joins` more nodes than it starts with (`--nnodes N:N+joins`)."""
        return RunConfig(
            script=job.script,
            script_args=job.script_args,
            nodes=job.nodes + joins,
            nproc_per_node=job.nproc_per_node,
            min_nodes=job.min_nodes,
            global_batch=job.global_batch,
            micro_batch=job.micro_batch,
            steps=job.steps,
            seed=job.seed,
            mode=job.mode,
            run_dir=run_dir,
            etcd_binary=self.etcd_binary,
            timeout=job.timeout,
            lease_ttl=job.hang_timeout,
            checkpoint_url=(run_dir / CHECKPOINTS).as_uri() if job.checkpoint_every else None,
            checkpoint_every=job.checkpoint_every,
            etcd_members=job.etcd_members,
            extra_env={"KEEPSTEP_SHARD": job.shard} if job.shard else {},
        )

    def run(self, job: Job, plan: RunPlan | None, run_dir: Path) -> RunOutcome:
        run_dir = run_dir.resolve()
        if run_dir.exists():
            shutil.rmtree(run_dir)  # event logs are appended to: an old run would mix in
        run_dir.mkdir(parents=True)
        mapped = map_faults(plan)
        cfg = self.run_config(job, mapped.joins, run_dir)
        cluster = self.cluster
        cluster.resize(job.nodes)  # the job starts on these; a join adds one
        ray_cfg = RayConfig(
            address=cluster.address, bundle={NODE_RESOURCE: 1.0}, faults=mapped.faults
        )
        watcher = _Watcher(RunView(run_dir))
        out = io.StringIO()
        started = time.time()
        watcher.start()
        summary: dict[str, Any] | None = None
        try:
            summary = run_on_ray(cfg, ray_cfg, out, cluster.replace, cluster.add)
            code: int | None = 1 if summary["failures"] else 0
        except (KeepstepError, ray.exceptions.RayError) as error:
            out.write(f"keepstep: error: {error}\n")
            code = 1
        finally:
            ended = time.time()
            watcher.halt()
            (run_dir / "launcher.out").write_text(out.getvalue())
        view = watcher.view
        view.poll()
        records = _landed(mapped.records, (summary or {}).get("faults", []))
        leftovers = _leftovers(view, job, run_dir) + [
            f"node actor process {pid}: {command_line(pid)[:120]}"
            for pid in cluster.actors_left(_LEFT_TIMEOUT_S)
        ]
        seen = Observation(
            code,
            ended,
            tuple(r.as_dict() for r in records),
            tuple(leftovers),
            tuple(sorted(view.checkpoints.items())),
        )
        tail = out.getvalue()[-3000:]
        return RunOutcome(run_dir, summary, read_events(run_dir), seen, started, tail, None)


def _landed(records: tuple[Applied, ...], logged: list[dict[str, Any]]) -> list[Applied]:
    """Each record with what the launcher's fault log says of it (matched by its Ray
    fault), or skipped when the launcher did not inject it."""
    logged = list(logged)
    out = []
    for rec in records:
        if rec.skipped is None:
            match = next((f for f in logged if f.get("spec") == rec.detail["ray"]), None)
            if match is None:
                rec.skipped = "the Ray launcher did not inject it (see launcher.out)"
            else:
                logged.remove(match)
                rec.node, rec.t, rec.step = match.get("node"), match.get("t"), match.get("step")
                rec.held = match.get("held")
                if match.get("ray_node"):
                    rec.detail["ray_node"] = match["ray_node"]
        out.append(rec)
    return out


def _leftovers(view: RunView, job: Job, run_dir: Path) -> list[str]:
    """The run's processes still there once the launcher returned (its agents, keepers,
    workers and etcd) and its snapshot files; each is killed or removed."""
    deadline = time.monotonic() + _LEFT_TIMEOUT_S
    while (named := processes_with(str(run_dir))) and time.monotonic() < deadline:
        time.sleep(0.2)  # a keeper ends its node's group a moment after its actor died
    found = [f"process {pid}: {command_line(pid)[:120]}" for pid in named]
    script = Path(job.script).name
    workers = [pid for pid in view.workers.values() if alive(pid)]
    found += [f"worker pid {pid}" for pid in workers if script in command_line(pid)]
    for pid in [*named, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    job_id = view.job_id()
    if job_id is not None:
        for shm in sorted(Path("/dev/shm").glob(f"keepstep-{job_id}-*")):
            found.append(f"snapshot file {shm}")
            shm.unlink(missing_ok=True)
    return found


class _Watcher(threading.Thread):
    """Reads the run directory while the job runs: the hashes of durable checkpoints are
    noted before the writer prunes them (`RunView`)."""

    def __init__(self, view: RunView) -> None:
        super().__init__(name="ray-chaos-watcher", daemon=True)
        self.view = view
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.wait(_POLL_S):
            with self._lock:
                self.view.poll()

    def halt(self) -> None:
        self._halt.set()
        self.join(timeout=_POLL_S * 4)
