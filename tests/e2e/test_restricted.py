"""Pod Security "restricted" on the real control plane: in a namespace that enforces it, a
TrainJob trains to completion (the API server's PodSecurity admission admits every pod the
operator builds), and a job whose podTemplate asks for root is refused pod by pod, with the
refusal in its PodCreateRefused condition.

The process-backed nodes run each pod's command as a local process and honour neither
securityContext nor volumes; what this shows is the admission: the real kube-apiserver's
PodSecurity plugin, at the `restricted:latest` level, checks every pod the operator creates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

from keepstep.e2e.controlplane import ControlPlane

from .helpers import REPO
from .training_fixtures import Training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture
def training(
    trainjob_crd: ControlPlane, jobs_etcd: str, namespace: str, tmp_path: Path
) -> Iterator[Training]:
    """Two nodes and the operator, in a namespace that enforces `restricted`."""
    cluster = Training(trainjob_crd, jobs_etcd, namespace, tmp_path)
    try:
        cluster.kubectl("label", "namespace", namespace, f"{ENFORCE}=restricted", namespaced=False)
        cluster.operator.start()
        for _ in range(2):
            cluster.add_node()
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"processes outlived the test (killed now): {left}"


def trainjob(name: str, **spec: Any) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(
        (REPO / "manifests" / "samples" / "mlp-minimal.yaml").read_text(encoding="utf-8")
    )
    job["metadata"]["name"] = name
    job["spec"]["trainer"].update(numNodes=2, numSteps=12, seed=1)
    job["spec"]["elasticPolicy"].update(minNodes=1, maxNodes=2, globalBatchSize=16)
    job["spec"].update(spec)
    return job


@pytest.mark.timeout(240)
def test_a_job_runs_to_completion_where_pod_security_is_restricted(training: Training) -> None:
    t = training
    # The namespace really enforces the profile: a plain pod is refused.
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["true"]}]},
    }
    done = t.cp.kubectl(
        "-n", t.namespace, "create", "--dry-run=server", "-f", "-", input=json.dumps(plain)
    )
    assert done.returncode != 0 and 'violates PodSecurity "restricted:latest"' in done.stderr

    # A template that asks for root: every pod refused, and the job says why.
    rooted = {"spec": {"securityContext": {"runAsNonRoot": False, "runAsUser": 0}}}
    t.apply(trainjob("rooted", podTemplate=rooted))
    t.apply(trainjob("mlp"))

    def refused() -> dict[str, Any] | None:
        found = [
            c for c in t.status("rooted").get("conditions", []) if c["type"] == "PodCreateRefused"
        ]
        return found[0] if found and found[0]["status"] == "True" else None

    condition = t.wait("rooted's PodCreateRefused condition", refused)
    assert condition["reason"] == "Forbidden", condition
    assert 'violates PodSecurity "restricted:latest"' in condition["message"], condition
    assert not t.pods("rooted")

    # The operator's own pods are admitted and the job trains to the end.
    t.wait("mlp Succeeded", lambda: t.status("mlp").get("phase") in ("Succeeded", "Failed"), 180)
    status = t.status("mlp")
    assert status["phase"] == "Succeeded", t.report()
    assert status["step"] == 12 and len(status["paramsSha256"]) == 64, status
    true = {c["type"] for c in status["conditions"] if c["status"] == "True"}
    assert {"Succeeded", "Complete"} <= true, status["conditions"]
    # The agents reported their snapshot files: later pods get a /dev/shm sized for them.
    assert status.get("snapshotBytes", 0) > 0, status
    for pod in t.pods("mlp").values():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        (container,) = spec["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
