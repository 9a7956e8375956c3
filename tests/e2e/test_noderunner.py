"""A process-backed node against the real control plane: it registers a Ready node, the
scheduler binds pods to it, their processes run with the downward-API env, and their
status, deletion and the whole-node faults (kill, hang, cut off) behave like a kubelet's.

Each test runs its own node, tainted so that only its own pods (which tolerate the taint
and select the node) land there, and checks that no pod process outlives it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.e2e import procs
from keepstep.e2e.controlplane import ControlPlane
from keepstep.e2e.nodeprocs import proc_state
from keepstep.e2e.noderunner import NodeRunner

from .helpers import REPO, api_get, node_ready, wait_for

pytestmark = pytest.mark.e2e

TAINT = "keepstep.dev/test-node"


def get_pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    pod: dict[str, Any] | None = api_get(cp, f"/api/v1/namespaces/{namespace}/pods/{name}")
    return pod


def container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod["status"].get("containerStatuses") or [{}]
    result: dict[str, Any] = statuses[0]
    return result


def pid_of(pod: dict[str, Any]) -> int:
    """The pod process's PID, from the containerID the node reports (process://PID)."""
    return int(container(pod)["containerID"].removeprefix("process://"))


class Node:
    """A started NodeRunner and how to put pods on it."""

    def __init__(self, cp: ControlPlane, runner: NodeRunner, namespace: str, ip: str) -> None:
        self.cp, self.runner, self.namespace, self.ip = cp, runner, namespace, ip
        self.name = runner.name
        self.work_dir = runner.config.work_dir

    def apply(
        self,
        name: str,
        code: str,
        *,
        restart: str = "Never",
        env: list[dict[str, Any]] | None = None,
        **spec: Any,
    ) -> None:
        """A pod running `python -c code` (WORK = the node's work dir in its env), which
        the scheduler can bind to this node only."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "restartPolicy": restart,
                "nodeSelector": {"kubernetes.io/hostname": self.name},
                "tolerations": [{"key": TAINT, "operator": "Equal", "value": self.name}],
                "containers": [
                    {
                        "name": "main",
                        "image": "ignored",
                        "command": [sys.executable, "-c", code],
                        "env": [{"name": "WORK", "value": str(self.work_dir)}, *(env or [])],
                    }
                ],
                **spec,
            },
        }
        self.cp.kubectl("apply", "-f", "-", input=json.dumps(pod), check=True)

    def pod(self, name: str) -> dict[str, Any] | None:
        return get_pod(self.cp, self.namespace, name)

    def wait_pod(
        self, name: str, what: str, test: Callable[[dict[str, Any]], bool], timeout: float = 30.0
    ) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            pod = self.pod(name)
            return pod if pod is not None and test(pod) else None

        return wait_for(f"pod {name}: {what}", probe, timeout)

    def wait_phase(self, name: str, phase: str, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_pod(name, phase, lambda p: p["status"].get("phase") == phase, timeout)

    def log(self, name: str) -> str:
        path = self.work_dir / f"{self.namespace}_{name}.log"
        return path.read_text() if path.exists() else ""

    def wait_log(self, name: str, text: str, timeout: float = 30.0) -> None:
        wait_for(f"{text!r} in the log of {name}", lambda: text in self.log(name) or None, timeout)

    def go(self, name: str) -> None:
        """Let a GATED pod's process finish."""
        (self.work_dir / f"go-{name}").write_text("")


@pytest.fixture
def node(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Node]:
    name = f"nr-{secrets.token_hex(3)}"
    ip = f"127.0.{secrets.randbelow(250) + 2}.{secrets.randbelow(250) + 2}"
    before = {r.pid for r in procs.descendants(os.getpid())}
    runner = NodeRunner(
        control_plane.kubeconfig, name, ip, tmp_path / "node", taints=[(TAINT, name, "NoSchedule")]
    )
    runner.start()
    try:
        yield Node(control_plane, runner, namespace, ip)
    finally:
        began = time.monotonic()
        runner.stop(timeout=5.0)
        # Nothing running is left to wait for: a slow stop is a thread that missed its cue.
        assert time.monotonic() - began < 10.0
        assert not runner.running()
        left = [r.pid for r in procs.descendants(os.getpid()) if r.pid not in before]
        assert left == [], f"processes left behind by node {name}: {left}"
        assert api_get(control_plane, f"/api/v1/nodes/{name}") is None  # stop() deregisters


def lease_path(node: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"


# Prints its downward-API env, then waits for a file (Node.go) and exits 0.
GATED = """
import os, pathlib, time
print("node=" + os.environ["MY_NODE"], "pod=" + os.environ["MY_POD"],
      "ip=" + os.environ["MY_IP"], flush=True)
go = pathlib.Path(os.environ["WORK"], "go-" + os.environ["MY_POD"])
while not go.exists():
    time.sleep(0.05)
"""
FIELD_ENV = [
    {"name": "MY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]
# Runs until SIGTERM, which it answers by writing a marker file and exiting 0; with
# IGNORE set it ignores SIGTERM instead.
LONG = """
import os, pathlib, signal, sys, time
def bye(*_):
    pathlib.Path(os.environ["WORK"], "sigterm-" + os.environ["MY_POD"]).write_text("x")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("IGNORE") else bye)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""
POD_NAME = [FIELD_ENV[1]]


def test_registers_a_ready_node_with_capacity_address_and_lease(
    control_plane: ControlPlane, node: Node
) -> None:
    obj = api_get(control_plane, f"/api/v1/nodes/{node.name}")
    assert obj is not None
    assert obj["status"]["allocatable"] == {"cpu": "8", "memory": "32Gi", "pods": "110"}
    assert {"type": "InternalIP", "address": node.ip} in obj["status"]["addresses"]
    assert node_ready(control_plane, node.name) == "True"
    lease = api_get(control_plane, lease_path(node.name))
    assert lease is not None and lease["spec"]["holderIdentity"] == node.name
    first = lease["spec"]["renewTime"]

    def renewed() -> bool | None:
        now = api_get(control_plane, lease_path(node.name))
        return True if now is not None and now["spec"]["renewTime"] != first else None

    wait_for("a Lease renewal", renewed, timeout=10.0)


def test_pod_runs_with_field_ref_env_then_succeeds(node: Node) -> None:
    node.apply("ok", GATED, env=FIELD_ENV)
    running = node.wait_phase("ok", "Running")
    assert running["spec"]["nodeName"] == node.name  # bound by the scheduler
    conditions = {c["type"]: c["status"] for c in running["status"]["conditions"]}
    assert conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert (running["status"]["podIP"], running["status"]["hostIP"]) == (node.ip, node.ip)
    assert "running" in container(running)["state"]
    pid = pid_of(running)
    assert node.runner.pids() == {f"{node.namespace}/ok": pid}
    node.wait_log("ok", f"node={node.name} pod=ok ip={node.ip}")

    node.go("ok")
    done = node.wait_phase("ok", "Succeeded")
    terminated = container(done)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert proc_state(pid) is None  # reaped


def test_pod_that_exits_3_fails_with_exit_code_3(node: Node) -> None:
    node.apply("bad", "raise SystemExit(3)")
    failed = node.wait_phase("bad", "Failed")
    terminated = container(failed)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert container(failed)["restartCount"] == 0


def test_pod_the_node_cannot_run_fails_with_the_reason(node: Node) -> None:
    node.apply(
        "unrunnable",
        "pass",
        env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    )
    failed = node.wait_phase("unrunnable", "Failed")
    terminated = container(failed)["state"]["terminated"]
    assert terminated["reason"] == "CreateContainerConfigError"
    assert "valueFrom secretKeyRef is not supported" in terminated["message"]


def test_on_failure_restarts_until_it_succeeds(node: Node) -> None:
    # Fails on the first run, succeeds on the second: the node restarted it once.
    code = (
        "import os, pathlib; f = pathlib.Path(os.environ['WORK'], 'runs'); "
        "n = len(f.read_text()) if f.exists() else 0; f.write_text('x' * (n + 1)); "
        "raise SystemExit(0 if n else 3)"
    )
    node.apply("retry", code, restart="OnFailure")
    done = node.wait_phase("retry", "Succeeded")
    status = container(done)
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["exitCode"] == 0


def test_deleting_a_pod_sigterms_it_then_the_object_goes(node: Node) -> None:
    node.apply("polite", LONG, env=POD_NAME, terminationGracePeriodSeconds=20)
    node.apply(
        "stubborn",
        LONG,
        env=[*POD_NAME, {"name": "IGNORE", "value": "1"}],
        terminationGracePeriodSeconds=1,
    )
    pids = {}
    for name in ("polite", "stubborn"):
        pids[name] = pid_of(node.wait_phase(name, "Running"))
        node.wait_log(name, "ready")  # its SIGTERM handler is in place
    began = time.monotonic()
    node.cp.kubectl(
        "delete", "pod", "polite", "stubborn", "-n", node.namespace, "--wait=false", check=True
    )
    wait_for("both pod objects to go", lambda: True if not any(node.pod(n) for n in pids) else None)
    # The polite one went on its SIGTERM (long before its 20 s grace); the stubborn one
    # needed the SIGKILL after its 1 s grace.
    assert time.monotonic() - began < 15.0
    assert (node.work_dir / "sigterm-polite").exists()
    assert not (node.work_dir / "sigterm-stubborn").exists()
    assert [proc_state(pid) for pid in pids.values()] == [None, None]
    assert node.runner.pids() == {}


def test_kill_stops_the_lease_kills_the_pods_and_the_node_goes_not_ready(
    control_plane: ControlPlane, node: Node
) -> None:
    node.apply("victim", LONG, env=POD_NAME)
    pid = pid_of(node.wait_phase("victim", "Running"))
    node.wait_log("victim", "ready")
    node.runner.kill()
    assert proc_state(pid) is None  # SIGKILLed and reaped at once
    assert not (node.work_dir / "sigterm-victim").exists()  # no SIGTERM first
    lease = api_get(control_plane, lease_path(node.name))
    assert lease is not None
    renewed = lease["spec"]["renewTime"]
    # The controller-manager runs with --node-monitor-grace-period=10s (ControlPlane's
    # default) and checks every second: NotReady (Unknown) well within 30 s.
    began = time.monotonic()
    status = wait_for(
        "the node to go NotReady",
        lambda: (
            node_ready(control_plane, node.name)
            if node_ready(control_plane, node.name) != "True"
            else None
        ),
        timeout=30.0,
    )
    assert status == "Unknown"
    assert time.monotonic() - began >= 5.0  # it was not the runner that said so
    lease = api_get(control_plane, lease_path(node.name))
    assert lease is not None and lease["spec"]["renewTime"] == renewed  # no renewal since


def test_start_after_kill_is_a_reboot_that_reports_lost_pods(
    control_plane: ControlPlane, node: Node
) -> None:
    node.apply("lost", LONG, env=POD_NAME)
    pid = pid_of(node.wait_phase("lost", "Running"))
    node.runner.kill()
    assert proc_state(pid) is None
    node.runner.start()  # before the controller evicts the pod
    failed = node.wait_phase("lost", "Failed")
    terminated = container(failed)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "ContainerStatusUnknown")
    assert node_ready(control_plane, node.name) == "True"


def test_hang_stops_the_pod_processes_and_resume_continues_them(node: Node) -> None:
    node.apply("sleeper", LONG, env=POD_NAME)
    pid = pid_of(node.wait_phase("sleeper", "Running"))
    node.runner.hang()
    wait_for("the process to be stopped", lambda: True if proc_state(pid) == "T" else None)
    # A pod bound while the node hangs does not start.
    node.apply("late", LONG, env=POD_NAME)
    node.wait_pod("late", "bound", lambda p: p["spec"].get("nodeName") == node.name)
    time.sleep(1.5)
    late = node.pod("late")
    assert late is not None and late["status"].get("phase") == "Pending"
    assert proc_state(pid) == "T"
    node.runner.resume()
    wait_for("the process to run again", lambda: True if proc_state(pid) in ("R", "S") else None)
    node.wait_phase("late", "Running")


def test_cut_off_keeps_pods_running_and_reconnect_reports_what_happened(
    control_plane: ControlPlane, node: Node
) -> None:
    node.apply("quiet", GATED, env=FIELD_ENV)
    pid = pid_of(node.wait_phase("quiet", "Running"))
    node.runner.cut_off()
    lease = api_get(control_plane, lease_path(node.name))
    assert lease is not None
    node.go("quiet")
    wait_for("the process to exit", lambda: True if proc_state(pid) is None else None)
    time.sleep(3.0)  # more than a heartbeat: nothing reaches the API server
    quiet = node.pod("quiet")
    assert quiet is not None and quiet["status"]["phase"] == "Running"
    after = api_get(control_plane, lease_path(node.name))
    assert after is not None and after["spec"]["renewTime"] == lease["spec"]["renewTime"]
    node.runner.reconnect()
    node.wait_phase("quiet", "Succeeded", timeout=15.0)


def test_command_line_registers_and_sigterm_deregisters(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    name = f"nr-cli-{secrets.token_hex(3)}"
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "keepstep.e2e.noderunner",
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "--name",
            name,
            "--ip",
            "127.0.200.1",
            "--work-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert runner.stdout is not None
        assert runner.stdout.readline().strip() == f"node {name} ready"
        assert node_ready(control_plane, name) == "True"
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(30.0) == 0
        assert api_get(control_plane, f"/api/v1/nodes/{name}") is None
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(10.0)
        control_plane.kubectl("delete", "node", name, "--ignore-not-found")
        for stream in (runner.stdout, runner.stderr):
            if stream is not None:
                stream.close()
