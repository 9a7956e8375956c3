"""The operator on the real control plane with the least it may do, in a namespace that
refuses its pods: it says why, backs off, and does not hammer the API server.

One operator process runs the namespaced install: started with --namespace, under a
ServiceAccount whose only permissions are manifests/namespaced/rbac.yaml's Role in its
namespace (no ClusterRole at all). The namespace holds a ResourceQuota of 0 pods, so every
pod creation is refused (403 Forbidden, "exceeded quota"). The test counts the refused
creations over a window from the API server's own request metrics, then lifts the quota,
and the job gets its pod; scaling, the status, the Service and the finalizer all work with
the Role's verbs alone. There are no nodes: pods stay Pending, which is all this needs.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

from keepstep.e2e.chaos_env import OperatorProcess
from keepstep.e2e.controlplane import ControlPlane
from keepstep.e2e.kubeconfig import write_kubeconfig

from .helpers import REPO, api_get, get_job, job_pods, wait_for

pytestmark = pytest.mark.e2e

ROLE = REPO / "manifests" / "namespaced" / "rbac.yaml"
WINDOW_S = 12.0
# Refused creations the API server saw for one pod in WINDOW_S: the backoff allows attempts
# at 0, 1, 3 and 7 s (and 15, outside); a fixed 1 s retry would make 12.
MOST_ATTEMPTS = 6


@dataclass
class Env:
    cp: ControlPlane
    namespace: str
    operator: OperatorProcess

    def kubectl(self, *args: str, input: str | None = None) -> str:
        done = self.cp.kubectl("-n", self.namespace, *args, input=input)
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout

    def status(self, name: str) -> dict[str, Any]:
        status: dict[str, Any] = (get_job(self.cp, self.namespace, name) or {}).get("status") or {}
        return status

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        found = [c for c in self.status(name).get("conditions", []) if c["type"] == kind]
        return found[0] if found else None

    def events(self, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.name={name}"
        path = f"/api/v1/namespaces/{self.namespace}/events?fieldSelector={selector}"
        items: list[dict[str, Any]] = api_get(self.cp, path)["items"]
        return items

    def report(self) -> str:
        return f"operator log:\n{self.operator.tail(4000)}"


def refused_pod_creates(cp: ControlPlane) -> int:
    """Pod creations the API server answered 403, from its own metrics (cluster-wide; no
    other test creates pods while this one runs)."""
    status, body = cp.access.get("/metrics", timeout=5.0)
    assert status == 200, status
    total = 0
    for line in body.decode().splitlines():
        if line.startswith("apiserver_request_total{") and all(
            f'{k}="{v}"' in line
            for k, v in (("code", "403"), ("resource", "pods"), ("verb", "POST"))
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


@pytest.fixture(scope="module")
def env(
    trainjob_crd: ControlPlane, jobs_etcd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Env]:
    cp = trainjob_crd
    namespace = f"safety-{os.getpid()}-{int(time.time()) % 100000}"
    cp.kubectl("create", "namespace", namespace, check=True)
    cp.wait_for_service_account(namespace)
    work = tmp_path_factory.mktemp("safety")
    # The namespaced install, its subject a ServiceAccount of the test's namespace.
    docs = list(yaml.safe_load_all(ROLE.read_text(encoding="utf-8")))
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
    cp.kubectl("create", "serviceaccount", "keepstep-operator", "-n", namespace, check=True)
    cp.kubectl("apply", "-f", "-", input=json.dumps({"kind": "List", "apiVersion": "v1",
                                                      "items": docs}), check=True)  # fmt: skip
    token = cp.kubectl(
        "create", "token", "keepstep-operator", "-n", namespace, "--duration=1h", check=True
    ).stdout.strip()
    kubeconfig = work / "operator.kubeconfig"
    write_kubeconfig(kubeconfig, replace(cp.access, token=token))
    argv = [sys.executable, "-m", "keepstep.operator", "--etcd", jobs_etcd]
    argv += ["--kubeconfig", str(kubeconfig), "--namespace", namespace, "--resync", "1"]
    operator = OperatorProcess(argv, work / "operator.log")
    operator.start()
    try:
        yield Env(cp, namespace, operator)
    finally:
        operator.stop()
        cp.kubectl("delete", "namespace", namespace, "--wait=false")


def trainjob(name: str) -> str:
    job: dict[str, Any] = yaml.safe_load(
        (REPO / "manifests" / "samples" / "mlp-minimal.yaml").read_text(encoding="utf-8")
    )
    job["metadata"]["name"] = name
    job["spec"]["trainer"]["numNodes"] = 1
    job["spec"]["elasticPolicy"]["maxNodes"] = 2
    return json.dumps(job)


def test_a_refused_pod_backs_off_says_why_and_runs_once_allowed(env: Env) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods"},
        "spec": {"hard": {"pods": "0"}},
    }
    env.kubectl("apply", "-f", "-", input=json.dumps(quota))
    quota_path = f"/api/v1/namespaces/{env.namespace}/resourcequotas/no-pods"
    wait_for(
        "the quota's status", lambda: api_get(env.cp, quota_path).get("status", {}).get("hard")
    )
    before = refused_pod_creates(env.cp)
    env.kubectl("apply", "-f", "-", input=trainjob("quota"))

    def refused() -> dict[str, Any] | None:
        found = env.condition("quota", "PodCreateRefused")
        return found if found is not None and found["status"] == "True" else None

    condition = wait_for("the PodCreateRefused condition", refused, 30.0, report=env.report)
    first = time.monotonic()
    assert condition["reason"] == "Forbidden", condition
    assert "exceeded quota: no-pods" in condition["message"], condition
    time.sleep(WINDOW_S)
    attempts = refused_pod_creates(env.cp) - before
    status = env.status("quota")
    recorded = [f for f in status.get("podFailures", []) if f["cause"] == "PodCreateRefused"]
    until = status.get("createBackoffUntil")
    print(
        f"\n{attempts} refused pod creations in the {time.monotonic() - first:.1f} s after the "
        f"first (a 1 s retry would be {WINDOW_S:.0f}); no new pod before {until}"
    )
    assert 2 <= attempts <= MOST_ATTEMPTS, (attempts, env.report())
    assert len(recorded) == attempts, (recorded, attempts)  # every attempt is on record
    assert status["phase"] == "Pending" and status["nextPodIndex"] == 0, status
    reasons = [e["reason"] for e in env.events("quota")]
    assert "CreatedPods" not in reasons, reasons  # no success event for a failure
    assert reasons.count("PodCreateRefused") == attempts, reasons  # one per attempt
    warning = next(e for e in env.events("quota") if e["reason"] == "PodCreateRefused")
    assert warning["type"] == "Warning" and "exceeded quota" in warning["message"]

    # The quota goes: the next attempt (within the backoff, at most 8 s away) succeeds.
    env.kubectl("delete", "resourcequota", "no-pods")
    wait_for("the pod", lambda: job_pods(env.cp, env.namespace, "quota"), 20.0, report=env.report)
    cleared = wait_for(
        "the condition to clear",
        lambda: (c := env.condition("quota", "PodCreateRefused")) and c["status"] == "False" and c,
        10.0,
        report=env.report,
    )
    assert cleared["reason"] == "PodsCreated"


def test_the_namespaced_role_is_all_the_operator_needs(env: Env) -> None:
    env.kubectl("apply", "-f", "-", input=trainjob("least"))
    wait_for("the pod", lambda: job_pods(env.cp, env.namespace, "least"), 20.0, report=env.report)
    service = api_get(env.cp, f"/api/v1/namespaces/{env.namespace}/services/least")
    assert service is not None and service["spec"]["clusterIP"] == "None"
    env.kubectl("scale", "trainjob/least", "--replicas=2")
    wait_for("2 pods", lambda: len(job_pods(env.cp, env.namespace, "least")) == 2, 20.0)
    env.kubectl("scale", "trainjob/least", "--replicas=1")
    wait_for("1 pod", lambda: sorted(job_pods(env.cp, env.namespace, "least")) == ["least-node-0"])
    assert env.status("least")["nextPodIndex"] == 2
    assert "CreatedPods" in [e["reason"] for e in env.events("least")]
    env.kubectl("delete", "trainjob", "least", "--wait=false")  # the finalizer is ours
    wait_for("the job gone", lambda: get_job(env.cp, env.namespace, "least") is None, 20.0)
    log = env.operator.tail(10**6)
    # Nothing the operator did was forbidden, and kopf did not look beyond the namespace.
    assert not re.search(r"Not enough permissions|APIForbiddenError|forbidden: User", log), log
    assert "reconcile of" not in log, log  # no reconcile failed
    pods = Path(f"/proc/{env.operator.proc.pid}") if env.operator.proc else None
    assert pods is not None and pods.exists(), "the operator exited"
