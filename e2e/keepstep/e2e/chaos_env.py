"""The cluster a cluster-mode chaos scenario runs on, with the handles its faults need.

Where it sits: `chaos.py` (the command line) starts one with `ChaosCluster.start`, a test
builds one on its session's control plane and job etcd with `ChaosCluster.on`; the
`ClusterTarget` (chaos_cluster.py) applies each run's TrainJob to it and the
`ClusterInjector` (chaos_inject.py) acts on its parts. It holds:

    the control plane     real kube-apiserver, scheduler, controller-manager (controlplane.py)
    an etcd for the jobs  the agents' records; the operator reads them
    nodes                 in-process `NodeRunner`s, so a fault can kill, hang or reboot one
    the operator          `python -m keepstep.operator` as a child process, restartable
    a namespace           of its own, deleted by `close`

`heal` puts the nodes back after a run (a killed node reboots, a hung one resumes) and
waits until they are Ready and schedulable, so every run starts on the same cluster.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from keepstep.e2e.controlplane import REPO, ControlPlane, build_binaries
from keepstep.e2e.noderunner import NodeRunner

CRD = REPO / "manifests" / "crd" / "trainjob.yaml"
# Status every second. The lost-pod grace stays above the control plane's node-monitor
# grace plus the eviction toleration (10 + 5 s): a replacement made earlier is bound by the
# scheduler to the dead node, which still looks Ready. The job never fails for being below
# minNodes while a scenario runs: the invariants say what went wrong instead.
OPERATOR_FLAGS = ("--resync", "1", "--lost-pod-grace", "20", "--below-min-grace", "600")
# Taints the node lifecycle controller sets on a node that stopped heartbeating.
_LIFECYCLE_TAINTS = "node.kubernetes.io/"
T = TypeVar("T")


class ChaosClusterError(RuntimeError):
    """The cluster could not be brought up, or back into shape between runs."""


class OperatorProcess:
    """The operator as a child process: started, stopped cleanly, or killed outright."""

    def __init__(self, argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self.env = None if env is None else dict(env)  # None: this process's environment
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )

    def kill(self, timeout: float = 10.0) -> int | None:
        """SIGKILL (a crash, nothing is cleaned up); the exit status once reaped."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (kopf shuts down cleanly), SIGKILL after `timeout`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait(10.0)

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class ChaosCluster:
    """One scenario's cluster; `close` stops what it started (the control plane and job
    etcd too when `start` made them)."""

    def __init__(self, cp: ControlPlane, etcd: str, work_dir: Path) -> None:
        self.cp, self.etcd, self.work_dir = cp, etcd, work_dir
        self.token = secrets.token_hex(3)
        self.namespace = f"chaos-{self.token}"
        self.subnet = 20 + secrets.randbelow(230)  # node i listens on 127.0.SUBNET.i+1
        self.runners: dict[str, NodeRunner] = {}
        argv = [sys.executable, "-m", "keepstep.operator", "--etcd", etcd]
        argv += ["--kubeconfig", str(cp.kubeconfig), "--namespace", self.namespace]
        self.operator = OperatorProcess([*argv, *OPERATOR_FLAGS], work_dir / "operator.log")
        self.killed: set[str] = set()  # nodes that crashed and must reboot
        self.hung: set[str] = set()
        self._owned: list[Callable[[], None]] = []  # how to stop what `start` made

    # -- bringing it up ------------------------------------------------------------------

    @classmethod
    def on(cls, cp: ControlPlane, etcd: str, work_dir: Path, nodes: int) -> ChaosCluster:
        """A cluster on a running control plane and job etcd: the TrainJob CRD, a
        namespace, `nodes` Ready nodes and the operator."""
        work_dir.mkdir(parents=True, exist_ok=True)
        cluster = cls(cp, etcd, work_dir)
        try:
            cluster._set_up(nodes)
        except BaseException:
            cluster.close()
            raise
        return cluster

    @classmethod
    def start(cls, work_dir: Path, nodes: int, timeout: float = 180.0) -> ChaosCluster:
        """Start a control plane and a job etcd in `work_dir` too (the command line)."""
        # Imported here: the agent's modules are only needed once a cluster starts.
        from keepstep.errors import ConfigError
        from keepstep.launch.etcd_server import EtcdServer, find_etcd

        work_dir = work_dir.resolve()
        cp = ControlPlane.start(work_dir / "controlplane", timeout=timeout)
        try:
            try:
                binary = find_etcd(os.environ)
            except ConfigError:
                binary = str(build_binaries() / "etcd")
            server = EtcdServer.start(binary, work_dir / "jobs-etcd")
        except BaseException:
            cp.stop()
            raise
        try:
            cluster = cls.on(cp, f"http://{server.endpoint}", work_dir, nodes)
        except BaseException:
            server.stop()
            cp.stop()
            raise
        cluster._owned += [server.stop, cp.stop]
        return cluster

    def _set_up(self, nodes: int) -> None:
        self.kubectl("apply", "-f", str(CRD))
        self.cp.wait_for_crds(["trainjobs.keepstep.dev"], timeout=60.0)
        self.kubectl("create", "namespace", self.namespace, namespaced=False)
        self.cp.wait_for_service_account(self.namespace)
        # Pods run in the repository (scenario scripts are relative to it) with this
        # process's environment; each job's TMPDIR puts the agents' run dirs where the
        # target reads them.
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for i in range(nodes):
            name = f"chaos-{self.token}-{i}"
            runner = NodeRunner(
                self.cp.kubeconfig,
                name,
                f"127.0.{self.subnet}.{i + 1}",
                self.work_dir / "nodes" / name,
                env=env,
                cwd=REPO,
            )
            self.runners[name] = runner
            runner.start()
        self.operator.start()
        self.wait("every node Ready", self._all_schedulable, timeout=60.0)

    # -- between runs --------------------------------------------------------------------

    def heal(self, timeout: float = 60.0) -> None:
        """Reboot crashed nodes, resume hung ones, start the operator if it is down, and
        wait until every node is Ready without the lifecycle controller's taints."""
        for name in sorted(self.hung):
            self.runners[name].resume()
        self.hung.clear()
        for name in sorted(self.killed):
            self.runners[name].start()
        self.killed.clear()
        self.operator.start()
        self.wait("every node Ready and schedulable", self._all_schedulable, timeout=timeout)

    def _all_schedulable(self) -> bool:
        return all(self._schedulable(name) for name in self.runners)

    def _schedulable(self, node: str) -> bool:
        obj = self.get(f"/api/v1/nodes/{node}")
        if obj is None:
            return False
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in obj.get("status", {}).get("conditions", [])
        )
        taints = obj.get("spec", {}).get("taints") or []
        return ready and not any(t["key"].startswith(_LIFECYCLE_TAINTS) for t in taints)

    # -- talking to the API server -------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, namespaced: bool = True, timeout: float = 60.0
    ) -> str:
        scope = ("-n", self.namespace) if namespaced else ()
        done = self.cp.kubectl(*scope, *args, input=input, timeout=timeout)
        if done.returncode != 0:
            raise ChaosClusterError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def get(self, path: str) -> Any:
        """GET `path` as JSON; None when it does not exist."""
        status, body = self.cp.access.get(path, timeout=10.0)
        if status == 404:
            return None
        if status != 200:
            raise ChaosClusterError(f"GET {path}: HTTP {status}: {body[:300]!r}")
        return json.loads(body)

    def trainjob(self, name: str) -> dict[str, Any] | None:
        path = f"/apis/keepstep.dev/v1alpha1/namespaces/{self.namespace}/trainjobs/{name}"
        job: dict[str, Any] | None = self.get(path)
        return job

    def pods(self, job: str) -> dict[str, dict[str, Any]]:
        """The job's pods by name."""
        path = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector=keepstep.dev/job%3D{job}"
        return {p["metadata"]["name"]: p for p in self.get(path)["items"]}

    def runner_of(self, job: str, pod: str) -> NodeRunner | None:
        """The node runner `pod` is bound to (None: not bound, or not one of ours)."""
        obj = self.pods(job).get(pod)
        node = (obj or {}).get("spec", {}).get("nodeName")
        return self.runners.get(node) if node else None

    def wait(self, what: str, probe: Callable[[], T | None], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() >= deadline:
                raise ChaosClusterError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.2)

    # -- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the nodes and the operator, delete the namespace, then stop what `start`
        started. Each step runs even if one before it failed."""
        try:
            self.operator.start()  # its finalizer must clear the jobs' etcd prefixes
            for job in self._jobs():
                self.cp.kubectl(
                    "-n", self.namespace, "delete", "trainjob", job, "--timeout=30s", timeout=45
                )
        finally:
            try:
                for runner in self.runners.values():
                    runner.stop(timeout=10.0)
            finally:
                self.operator.stop()
                self.cp.kubectl("delete", "namespace", self.namespace, "--wait=false")
                for stop in self._owned:
                    stop()

    def _jobs(self) -> list[str]:
        path = f"/apis/keepstep.dev/v1alpha1/namespaces/{self.namespace}/trainjobs"
        found = self.get(path) or {"items": []}
        return [j["metadata"]["name"] for j in found["items"]]
