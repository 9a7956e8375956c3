"""A TrainJob on kwok nodes: the operator at a scale no process-backed node reaches.

kwok (keepstep.e2e.kwok) plays the kubelet of NODES fake Node objects: the real scheduler
binds the job's pods to them and kwok moves each to Running. No agent runs in those pods;
the test plays the agents by writing their records into the job etcd
(keepstep.agent.protocol), as test_operator.py does, so that the operator's status goes
from Pending (pods Running, no epoch) to Running with every node live. A deleted pod is
replaced, bound and Running again, and the status follows.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv.etcd import EtcdKV
from keepstep.e2e.controlplane import ControlPlane
from keepstep.e2e.kwok import Kwok, KwokConfig
from keepstep.e2e.kwok_nodes import KwokNodes, kwok_trainjob

from .helpers import Operator, api_delete, job_pods, job_status, wait_for

pytestmark = pytest.mark.e2e

NODES = 50
# The shared control plane marks a node whose Lease is 10 s old NotReady; kwok renews a
# quarter of the way through the lease.
LEASE_S = 20


@pytest.fixture
def kwok_nodes(control_plane: ControlPlane, tmp_path: Path) -> Iterator[KwokNodes]:
    """NODES schedulable kwok nodes of this test's own (a kwok that plays only them)."""
    manage = f"t-{secrets.token_hex(3)}"
    kwok = Kwok.start(KwokConfig(control_plane.kubeconfig, tmp_path / "kwok", manage, LEASE_S))
    nodes = KwokNodes(control_plane.kubeconfig, control_plane.access, manage)
    try:
        nodes.create(NODES, f"kwok-{manage}")
        nodes.wait_schedulable(NODES, timeout=40.0)
        yield nodes
    finally:
        try:
            nodes.delete()
            wait_for("the kwok nodes to go", lambda: not nodes.list(), 30.0, every=0.25)
        finally:
            nodes.close()
            kwok.stop()
    assert not kwok.running()


def running_on(pods: dict[str, Any], names: set[str]) -> dict[str, str]:
    """pod -> node of the pods that are Running on one of `names`."""
    return {
        pod: obj["spec"]["nodeName"]
        for pod, obj in pods.items()
        if obj["spec"].get("nodeName") in names and obj["status"].get("phase") == "Running"
    }


def play_agents(kv: EtcdKV, job_key: str, pods: list[str], step: int) -> None:
    """What the agents of `pods` would write once they agreed epoch 1 and trained."""
    members = [protocol.member_id(p, 0) for p in sorted(pods)]
    kv.put(protocol.key(job_key, "epoch"), protocol.encode(protocol.EpochRecord(1, members)), 5.0)
    for pod in pods:
        record = protocol.NodeRecord(pod, "10.240.0.1", 1, 2)
        kv.put(protocol.key(job_key, "nodes", pod), protocol.encode(record), 5.0)
        progress = protocol.ProgressRecord(pod, step, 1, len(pods), 100.0)
        kv.put(protocol.key(job_key, "progress", pod), protocol.encode(progress), 5.0)


def test_a_job_on_kwok_nodes_gets_every_pod_bound_running_and_a_true_status(
    trainjob_crd: ControlPlane,
    jobs_etcd: str,
    namespace: str,
    kwok_nodes: KwokNodes,
    tmp_path: Path,
) -> None:
    cp, name, key = trainjob_crd, "wide", f"{namespace}.wide"
    ours = set(kwok_nodes.names)
    operator = Operator(cp, jobs_etcd, namespace, tmp_path / "operator.log", ("--resync", "1"))
    kv = EtcdKV(jobs_etcd, timeout=5.0)
    operator.start()
    try:

        def report() -> str:
            status = json.dumps(job_status(cp, namespace, name))
            return f"status: {status}\noperator log tail:\n{operator.tail()}"

        cp.kubectl(
            "create", "-n", namespace, "-f", "-", input=kwok_trainjob(name, NODES), check=True
        )
        wait_for(
            f"{NODES} pods bound and Running on the kwok nodes",
            lambda: len(running_on(job_pods(cp, namespace, name), ours)) == NODES,
            60.0,
            every=0.25,
            report=report,
        )
        pods = job_pods(cp, namespace, name)
        assert sorted(pods) == sorted(f"{name}-node-{i}" for i in range(NODES))
        # The scheduler spreads the pods: most of them on a node of their own.
        assert len(set(running_on(pods, ours).values())) > NODES // 2

        # Pods run, but no agent has registered: the job waits for its epoch.
        wait_for(
            "the operator's status of the running pods",
            lambda: job_status(cp, namespace, name).get("nextPodIndex") == NODES,
            report=report,
        )
        status = job_status(cp, namespace, name)
        assert (status["phase"], status["nodes"], status["worldSize"]) == ("Pending", 0, 0)
        assert status["selector"] == f"keepstep.dev/job={name}"

        play_agents(kv, key, sorted(pods), step=7)

        def running() -> dict[str, Any] | None:
            status = job_status(cp, namespace, name)
            return status if status.get("phase") == "Running" else None

        status = wait_for("phase Running", running, report=report)
        assert (status["nodes"], status["worldSize"], status["step"]) == (NODES, NODES, 7)
        assert {c["type"]: c["status"] for c in status["conditions"]}["Running"] == "True"

        # A lost pod: its agent's record goes with it, a new pod takes its place.
        victim, replacement = f"{name}-node-7", f"{name}-node-{NODES}"
        api_delete(cp, f"/api/v1/namespaces/{namespace}/pods/{victim}")
        kv.delete(protocol.key(key, "nodes", victim), 5.0)
        wait_for(
            f"{replacement} bound and Running",
            lambda: replacement in running_on(job_pods(cp, namespace, name), ours),
            30.0,
            report=report,
        )
        wait_for("the victim gone", lambda: victim not in job_pods(cp, namespace, name))
        assert len(running_on(job_pods(cp, namespace, name), ours)) == NODES

        def counted() -> dict[str, Any] | None:
            status = job_status(cp, namespace, name)
            return status if status.get("nodes") == NODES - 1 else None

        status = wait_for("the status to count the lost agent", counted, report=report)
        assert (status["phase"], status["nextPodIndex"]) == ("Running", NODES + 1)
    finally:
        try:
            # The finalizer needs the operator: delete the job while it runs.
            cp.kubectl("delete", "-n", namespace, "trainjob", name, "--timeout=30s")
        finally:
            operator.stop()
            kv.close()
