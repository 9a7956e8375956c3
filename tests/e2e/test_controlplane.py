"""The local control plane is a real one: kubectl reaches it, the scheduler binds pods to
Ready nodes, the controller-manager's controllers run, and stop() leaves nothing behind."""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from keepstep.e2e import procs
from keepstep.e2e.controlplane import ControlPlane, build_binaries
from keepstep.e2e.procs import StartupError

from .helpers import wait_for

pytestmark = pytest.mark.e2e


def get_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json", check=True).stdout)


def test_kubectl_reaches_a_ready_api_server(control_plane: ControlPlane) -> None:
    done = control_plane.kubectl("get", "--raw", "/readyz")
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr
    version = json.loads(control_plane.kubectl("version", "-o", "json", check=True).stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.34.4"
    assert control_plane.server.startswith("https://127.0.0.1:")


def test_scheduler_binds_a_pod_to_a_ready_node(control_plane: ControlPlane, namespace: str) -> None:
    node = f"e2e-node-{secrets.token_hex(3)}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": namespace},
        "spec": {
            # Only our node qualifies, whatever other nodes this shared control plane has.
            "nodeSelector": {"keepstep.dev/e2e-node": node},
            "containers": [{"name": "c", "image": "none", "command": ["true"]}],
        },
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(pod), check=True)

    def unschedulable() -> bool | None:
        conditions = get_json(control_plane, "pod", "p", "-n", namespace)["status"]
        for cond in conditions.get("conditions", []):
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return True
        return None

    # The scheduler saw the pod and found no node for it: it is not just slow to start.
    wait_for("the scheduler to report the pod Unschedulable", unschedulable)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "4", "memory": "8Gi", "pods": "10"}
    node_obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {"keepstep.dev/e2e-node": node}},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.9.1"}],
        },
    }
    try:
        control_plane.kubectl("create", "-f", "-", input=json.dumps(node_obj), check=True)
        bound = wait_for(
            "the pod to be bound to the node",
            lambda: get_json(control_plane, "pod", "p", "-n", namespace)["spec"].get("nodeName"),
        )
        assert bound == node
    finally:
        # No kubelet will ever finish this pod's deletion: remove it outright.
        control_plane.kubectl(
            "delete",
            "pod",
            "p",
            "-n",
            namespace,
            "--force",
            "--grace-period=0",
            "--ignore-not-found",
        )
        control_plane.kubectl("delete", "node", node, "--ignore-not-found")


def test_controller_manager_runs_deployments_and_garbage_collection(
    control_plane: ControlPlane, namespace: str
) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": namespace},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "metadata": {"labels": {"app": "d"}},
                "spec": {
                    # Never scheduled: no process-backed node of another test may run it.
                    "nodeSelector": {"keepstep.dev/no-such-node": "true"},
                    "containers": [{"name": "c", "image": "none", "command": ["true"]}],
                },
            },
        },
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(deployment), check=True)

    def owned_by(kind: str, name: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            item
            for item in items
            for ref in item["metadata"].get("ownerReferences", [])
            if ref["kind"] == kind and ref["name"] == name
        ]

    replica_sets = wait_for(
        "the deployment's ReplicaSet",
        lambda: (
            owned_by("Deployment", "d", get_json(control_plane, "rs", "-n", namespace)["items"])
            or None
        ),
    )
    assert len(replica_sets) == 1
    rs = replica_sets[0]["metadata"]["name"]

    def two_pods() -> list[dict[str, Any]] | None:
        pods = owned_by("ReplicaSet", rs, get_json(control_plane, "pods", "-n", namespace)["items"])
        return pods if len(pods) == 2 else None

    pods = wait_for("the ReplicaSet's two pods", two_pods)
    assert {p["spec"].get("nodeName") for p in pods} == {None}

    control_plane.kubectl("delete", "deployment", "d", "-n", namespace, "--wait=false", check=True)
    # The garbage collector removes what the deployment owned.
    wait_for(
        "the garbage collector to delete the ReplicaSet",
        lambda: True if not get_json(control_plane, "rs", "-n", namespace)["items"] else None,
    )


def test_jobs_etcd_is_an_etcd_of_its_own(control_plane: ControlPlane, jobs_etcd: str) -> None:
    assert jobs_etcd.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(f"{jobs_etcd}/health", timeout=5.0) as response:
        assert json.loads(response.read())["health"] == "true"
    # Not the control plane's etcd: jobs' records never mix with Kubernetes objects.
    etcd_args = Path(f"/proc/{control_plane.pids['etcd']}/cmdline").read_text()
    assert jobs_etcd.rsplit(":", 1)[1] not in etcd_args


def test_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    cp = ControlPlane.start(tmp_path / "cp", timeout=90.0)
    pids = cp.pids
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    assert all(Path(f"/proc/{pid}").exists() for pid in pids.values())
    port = int(cp.server.rsplit(":", 1)[1])
    assert cp.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
    for name in pids:
        assert (tmp_path / "cp" / f"{name}.log").exists()

    cp.stop()
    # Gone, not zombies: stop() reaps its children.
    assert [pid for pid in pids.values() if Path(f"/proc/{pid}").exists()] == []
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2.0):
        pass
    cp.stop()  # a second stop is harmless


def test_a_failing_component_is_named_with_its_log(tmp_path: Path) -> None:
    real = build_binaries()
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("etcd", "kubectl", "kube-controller-manager", "kube-scheduler"):
        (fake / name).symlink_to(real / name)
    apiserver = fake / "kube-apiserver"
    apiserver.write_text("#!/bin/sh\necho 'error: unknown flag: --no-such-thing' >&2\nexit 3\n")
    apiserver.chmod(apiserver.stat().st_mode | stat.S_IXUSR)
    before = {r.pid for r in procs.descendants(os.getpid())}

    with pytest.raises(StartupError) as caught:
        ControlPlane.start(tmp_path / "cp", timeout=60.0, bin_dir=fake)

    assert caught.value.component == "kube-apiserver"
    assert "exited with status 3" in str(caught.value)
    assert "unknown flag: --no-such-thing" in str(caught.value)
    # The etcd it had started already is stopped again.
    assert {r.pid for r in procs.descendants(os.getpid())} <= before
