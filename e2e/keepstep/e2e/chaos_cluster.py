"""Cluster mode of the chaos harness: each run of a scenario is a TrainJob on a real cluster.

Where it sits: `keepstep.chaos.runner.run_scenario` calls `ClusterTarget.run` for
every run of a scenario (the fault-free reference is the same job run locally: its
numbers are the same by design, and it is cached). One run:

    1. apply the TrainJob equivalent to the scenario's job (chaos_trainjob.py)
    2. inject the run's faults into the cluster (chaos_inject.py) while it trains
    3. wait until the TrainJob is Succeeded or Failed and no pod process of it runs
    4. read the agents' event logs (each pod's TMPDIR is inside the run directory) and
       build the summary `keepstep run` would have written; note what was left behind
       (a process of the job, a snapshot file), kill and remove it
    5. put the cluster back (reboot a killed node, resume a hung one) and delete the job

The invariants (`keepstep.chaos.invariants`) then judge it exactly as a local run.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keepstep.agent.protocol.events import read_events
from keepstep.chaos.inject import Applied
from keepstep.chaos.invariants import Observation
from keepstep.chaos.model import FaultKind, Job
from keepstep.chaos.rundir import CHECKPOINTS
from keepstep.chaos.runner import ChaosError
from keepstep.chaos.schedule import RunPlan
from keepstep.chaos.target import RunOutcome
from keepstep.e2e.chaos_env import ChaosCluster, ChaosClusterError
from keepstep.e2e.chaos_inject import ClusterInjector
from keepstep.e2e.chaos_trainjob import (
    FINAL_PHASES,
    exit_codes,
    job_problems,
    phase,
    run_summary,
    trainjob_manifest,
)
from keepstep.e2e.nodeprocs import proc_state

KILL_ETCD_SKIP = (
    "cluster mode does not kill the jobs' etcd: the operator and every job of the cluster "
    "share it (local mode kills the run's own etcd)"
)
PARTITION_SKIP = (
    "partition-node needs each node's pods in a network namespace of their own; the node "
    "runner starts pods in the host's (a node can only be cut off from the API server, "
    "which leaves the training traffic untouched)"
)
# Pods are scheduled and their agents import torch before the first step: on a busy
# machine that is up to ~30 s more than `keepstep run` needs.
START_ALLOWANCE_S = 90.0
_POLL_S = 0.25


def nodes_needed(job: Job, plans: list[RunPlan]) -> int:
    """Nodes for the scenario: the job's, one per join, and one free node for each pod
    a fault takes out (the operator's replacement must go somewhere; one pod fits a
    node), at least one."""
    extra = max(
        (
            sum(1 for f in p.faults if f.kind is FaultKind.JOIN_NODE or f.kind.removes_node)
            for p in plans
        ),
        default=0,
    )
    return job.nodes + max(extra, 1)


class ClusterTarget:
    """Runs on `cluster`, or on the one `cluster()` starts when the first run needs it
    (a scenario skipped as a whole starts none)."""

    name = "cluster"

    def __init__(self, cluster: ChaosCluster | Callable[[], ChaosCluster]) -> None:
        self.started: ChaosCluster | None = None
        self._make: Callable[[], ChaosCluster] | None = None
        if isinstance(cluster, ChaosCluster):
            self.started = cluster
        else:
            self._make = cluster

    @property
    def cluster(self) -> ChaosCluster:
        if self.started is None:
            assert self._make is not None
            self.started = self._make()
        return self.started

    def unsupported(self) -> dict[FaultKind, str]:
        return {FaultKind.KILL_ETCD: KILL_ETCD_SKIP, FaultKind.PARTITION_NODE: PARTITION_SKIP}

    def run(self, job: Job, plan: RunPlan | None, run_dir: Path) -> RunOutcome:
        problems = job_problems(job)
        if problems:
            raise ChaosError("cluster mode cannot run this job: " + "; ".join(problems))
        run_dir = run_dir.resolve()
        if run_dir.exists():
            raise ChaosError(f"{run_dir} exists: a cluster run needs a fresh directory")
        # A DNS label, unique on this cluster: pod names are never reused within a job.
        name = f"{run_dir.name.lower().replace('_', '-')[:30]}-{secrets.token_hex(2)}"
        key = f"{self.cluster.namespace}.{name}"
        tmpdir = run_dir / "pods"
        tmpdir.mkdir(parents=True)  # tempfile ignores a TMPDIR that does not exist
        agents_dir = tmpdir / "keepstep" / key  # where `keepstep agent` puts its run dir
        faults = tuple(enumerate(plan.faults)) if plan is not None else ()
        joins = sum(1 for _, f in faults if f.kind is FaultKind.JOIN_NODE)
        manifest = trainjob_manifest(
            job, name, joins=joins, tmpdir=tmpdir, checkpoints=agents_dir / CHECKPOINTS
        )
        (run_dir / "trainjob.json").write_text(json.dumps(manifest, indent=2))
        injector = ClusterInjector(
            agents_dir, self.cluster, name, job.nodes, faults, self.unsupported()
        )
        started = time.time()
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        injector.start()
        try:
            code, ended = self._wait(name, job.timeout + START_ALLOWANCE_S)
        except BaseException:
            injector.finish()
            self._clean_up(name)
            raise
        records = injector.finish()
        pods = self.cluster.pods(name)
        leftovers = _leftovers(key)
        events = read_events(agents_dir) if agents_dir.exists() else []
        applied = [r.as_dict() for r in records]
        summary = None
        if events:
            summary = run_summary(events, applied, job, exit_codes(pods))
            (agents_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        view = injector.view
        view.poll()
        tail = self._describe(name, pods, records)
        (run_dir / "cluster.txt").write_text(tail)
        self._clean_up(name)
        seen = Observation(
            code, ended, tuple(applied), tuple(leftovers), tuple(sorted(view.checkpoints.items()))
        )
        error = repr(injector.error) if injector.error is not None else None
        # The run directory of record is the agents' (events and summary.json), as for
        # `keepstep chaos check`.
        return RunOutcome(agents_dir, summary, events, seen, started, tail[-3000:], error)

    def _wait(self, name: str, timeout: float) -> tuple[int | None, float]:
        """(0 if the TrainJob Succeeded, 1 if it Failed, None if it did not end in time;
        when it ended): the job has a final phase and none of its pod processes runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            final = phase(self.cluster.trainjob(name))
            if final in FINAL_PHASES and not self._running_pods(name):
                return (0 if final == "Succeeded" else 1), time.time()
            time.sleep(_POLL_S)
        return None, time.time()

    def _running_pods(self, name: str) -> list[str]:
        prefix = f"{self.cluster.namespace}/{name}-node-"
        return [
            pod
            for runner in self.cluster.runners.values()
            for pod, pid in runner.pids().items()
            if pod.startswith(prefix) and proc_state(pid) not in (None, "Z")
        ]

    def _describe(self, name: str, pods: dict[str, Any], records: list[Applied]) -> str:
        """What a failed run shows: the job's status, its pods, the faults, log tails."""
        lines = [
            f"trainjob {name}: {json.dumps((self.cluster.trainjob(name) or {}).get('status'))}"
        ]
        for pod, obj in sorted(pods.items()):
            st = obj.get("status") or {}
            lines.append(f"  pod {pod} on {obj['spec'].get('nodeName')}: {st.get('phase')}")
        lines += [f"  fault {r.spec}: t={r.t} skipped={r.skipped} {r.detail}" for r in records]
        lines.append(f"--- operator log:\n{self.cluster.operator.tail()}")
        return "\n".join(lines)

    def _clean_up(self, name: str) -> None:
        """Put the cluster back for the next run, then delete the job (its pods go with
        it; the operator's finalizer clears its etcd prefix)."""
        try:
            self.cluster.heal()
        finally:
            try:
                self.cluster.kubectl("delete", "trainjob", name, "--timeout=60s", timeout=90.0)
            except ChaosClusterError as error:
                raise ChaosError(f"the TrainJob {name} could not be deleted: {error}") from None


def _leftovers(key: str) -> list[str]:
    """Processes of the job (agents and workers carry KEEPSTEP_JOB=<key> in their
    environment) and its shared-memory snapshots still there after the run ended; each
    is killed or removed."""
    wanted = f"KEEPSTEP_JOB={key}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if wanted in environ and proc_state(int(entry.name)) not in (None, "Z"):
            found.append(f"process {entry.name}: {cmdline.decode(errors='replace')[:120]}")
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                os.kill(int(entry.name), signal.SIGCONT)
            except OSError:
                pass
    for shm in sorted(Path("/dev/shm").glob(f"keepstep-{key}-*")):
        found.append(f"snapshot file {shm}")
        shm.unlink(missing_ok=True)
    return found
