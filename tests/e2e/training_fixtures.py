"""Shared pieces of the end-to-end training tests (test_training.py): a TrainJob trained by
real agents in pods on process-backed nodes, watched by a real operator process.

Where it sits: on top of conftest.py's control plane, job etcd and namespace. `Training`
starts `NodeRunner`s (the pods' processes run in the repository root, with this process's
environment, so `keepstep` and `python examples/mlp.py` resolve) and the operator as
`python -m keepstep.operator`, the way `e2e/cluster up` does; its teardown deletes the
TrainJobs while the operator still runs (its finalizer clears the job's etcd prefix), stops
the nodes and the operator, and fails the test if any pod process or worker outlived them.
The agents' event logs land in `run_dir` because every pod gets TMPDIR=<tmp>/pods.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from keepstep.agent import protocol
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.protocol.events import read_events
from keepstep.e2e.chaos_env import OperatorProcess
from keepstep.e2e.controlplane import ControlPlane
from keepstep.e2e.nodeprocs import proc_state
from keepstep.e2e.noderunner import NodeRunner

from .helpers import REPO, Operator, get_job, job_pods, job_status, wait_for

SPARE_TAINT = ("keepstep.dev/spare", "true", "NoSchedule")
# Status at least every second. The lost-pod grace stays above the control plane's
# node-monitor grace plus the eviction toleration (10 + 5 s): a replacement made earlier is
# bound by the scheduler to the dead node, which still looks Ready, and waits there for the
# eviction; and it stays above an agent's start-up time (torch's import on a busy machine),
# which the operator counts against a new pod whose agent has not registered yet.
OPERATOR_FLAGS = ("--resync", "1", "--lost-pod-grace", "20", "--below-min-grace", "600")
T = TypeVar("T")


class Training:
    """One test's cluster: its nodes, the operator, the job etcd and the agents' run dir."""

    def __init__(
        self,
        cp: ControlPlane,
        etcd: str,
        namespace: str,
        tmp: Path,
        *,
        operator_flags: Sequence[str] = OPERATOR_FLAGS,
        credentials: EtcdCredentials | None = None,
        operator: OperatorProcess | None = None,
    ) -> None:
        """`operator_flags`: the operator's flags besides its etcd, kubeconfig and
        namespace; `credentials`: what the test reads etcd with (a TLS etcd's root);
        `operator`: an operator started some other way (its flags are its own)."""
        self.cp, self.etcd, self.namespace, self.tmp = cp, etcd, namespace, tmp
        self.token = secrets.token_hex(3)
        self.subnet = 20 + secrets.randbelow(230)  # pods of node i listen on 127.0.SUBNET.i+1
        # tempfile ignores a TMPDIR that does not exist: the agents' run dirs go in here.
        (tmp / "pods").mkdir()
        self.pod_env = dict(os.environ, TMPDIR=str(tmp / "pods"), OMP_NUM_THREADS="1")
        self.runners: dict[str, NodeRunner] = {}
        self.operator = operator or Operator(
            cp, etcd, namespace, tmp / "operator.log", operator_flags
        )
        self.kv = EtcdKV(etcd, timeout=5.0, credentials=credentials)
        self.jobs: list[str] = []

    # -- setting up ------------------------------------------------------------------------

    def add_node(self, *, spare: bool = False) -> NodeRunner:
        """Start a Ready node; a spare carries SPARE_TAINT until `untaint` (no pod of a
        TrainJob tolerates it), so the job's first pods go elsewhere."""
        i = len(self.runners)
        name = f"tr-{self.token}-{i}"
        runner = NodeRunner(
            self.cp.kubeconfig,
            name,
            f"127.0.{self.subnet}.{i + 1}",
            self.tmp / "nodes" / name,
            env=self.pod_env,
            cwd=REPO,
            taints=[SPARE_TAINT] if spare else [],
        )
        self.runners[name] = runner
        runner.start()
        return runner

    def untaint(self, node: str) -> None:
        self.kubectl(
            "taint", "nodes", node, f"{SPARE_TAINT[0]}:{SPARE_TAINT[2]}-", namespaced=False
        )

    def apply(self, job: dict[str, Any]) -> None:
        self.jobs.append(job["metadata"]["name"])
        self.kubectl("apply", "-f", "-", input=json.dumps(job))

    # -- observing -------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, namespaced: bool = True) -> str:
        scope = ("-n", self.namespace) if namespaced else ()
        done = self.cp.kubectl(*scope, *args, input=input)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def job(self, name: str) -> Any:
        return get_job(self.cp, self.namespace, name)

    def status(self, name: str) -> dict[str, Any]:
        return job_status(self.cp, self.namespace, name)

    def pods(self, name: str) -> dict[str, Any]:
        return job_pods(self.cp, self.namespace, name)

    def job_key(self, name: str) -> str:
        return f"{self.namespace}.{name}"

    def committed(self, name: str) -> int:
        """The most steps any agent reported committed (its progress record)."""
        kvs = self.kv.get_prefix(protocol.prefix(self.job_key(name), "progress"), 5.0)
        return max(
            (protocol.decode(protocol.ProgressRecord, kv.value).step for kv in kvs), default=0
        )

    @property
    def run_dir(self) -> Path:
        return self.tmp / "pods" / "keepstep"

    def events(self, name: str) -> list[dict[str, Any]]:
        run_dir = self.run_dir / self.job_key(name)
        return read_events(run_dir) if run_dir.exists() else []

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
        return wait_for(what, probe, timeout, report=self.report)

    def report(self) -> str:
        """What a failed test prints: statuses, pods, epochs, log tails."""
        lines = []
        for name in self.jobs:
            lines.append(f"trainjob {name} status: {json.dumps(self.status(name))}")
            for pod, obj in sorted(self.pods(name).items()):
                st = obj.get("status") or {}
                lines.append(f"  pod {pod} on {obj['spec'].get('nodeName')}: {st.get('phase')}")
            agreed = [e for e in self.events(name) if e["kind"] == "epoch-agreed"]
            lines += [f"  epoch {e['epoch']}: {e['members']} ({e.get('reason')})" for e in agreed]
        for log in sorted(self.tmp.glob("nodes/*/*.log")):
            lines.append(f"--- {log.name} (node {log.parent.name}):\n{log.read_text()[-1500:]}")
        lines.append(f"--- operator log:\n{self.operator.tail()}")
        return "\n".join(lines)

    # -- tearing down ----------------------------------------------------------------------

    def close(self) -> list[str]:
        """Delete the jobs, stop nodes and operator; what was left running (and killed)."""
        try:
            if self.jobs and self.operator.proc is None:
                self.operator.start()  # its finalizer must clear the jobs' etcd prefixes
            for name in self.jobs:
                self.cp.kubectl("-n", self.namespace, "delete", "trainjob", name, "--timeout=30s")
        finally:
            try:
                for runner in self.runners.values():
                    runner.stop(timeout=10.0)
            finally:
                self.operator.stop()
                self.kv.close()
        # A killed node still lists the pods it had; only a live (not zombie) PID counts.
        left = [
            f"{node}: {pod} pid {pid}"
            for node, runner in self.runners.items()
            for pod, pid in runner.pids().items()
            if proc_state(pid) not in (None, "Z")
        ]
        return left + leftovers([self.job_key(name) for name in self.jobs])


def leftovers(job_keys: list[str]) -> list[str]:
    """Processes whose environment names one of the jobs (agents, workers); killed here,
    since this test started them, and returned so that the test fails."""
    wanted = [f"KEEPSTEP_JOB={k}\0".encode() for k in job_keys]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(w in environ for w in wanted):
            found.append(f"pid {entry.name}: {cmdline[:200]}")
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass
    return found
