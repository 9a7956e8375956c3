"""What the end-to-end tests share: polling with a deadline, reading API objects, a node's
Ready condition, and the operator run as a process.

Where it sits: beside conftest.py (which holds the fixtures); every tests/e2e module that
waits for the cluster or reads TrainJobs and pods imports these instead of keeping its own
copy. Reads are single HTTPS requests with the admin's token (`ControlPlane.access`), so
polling never starts a kubectl process.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from keepstep.e2e.chaos_env import OperatorProcess
from keepstep.e2e.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "manifests" / "crd" / "trainjob.yaml"
T = TypeVar("T")


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    *,
    every: float = 0.1,
    report: Callable[[], str] | None = None,
) -> T:
    """Poll `probe` until it returns a truthy value, and return that value; fail the test
    after `timeout` seconds, with `report()` (what the cluster looked like) if given."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = f"\n{report()}" if report is not None else ""
            pytest.fail(f"timed out after {timeout} s waiting for {what}{detail}")
        time.sleep(every)


def api_get(cp: ControlPlane, path: str) -> Any:
    """GET an API object or list (one HTTPS request); None if it does not exist."""
    status, body = cp.access.get(path, timeout=5.0)
    if status == 404:
        return None
    assert status == 200, f"GET {path}: {status} {body[:300]!r}"
    return json.loads(body)


def api_delete(cp: ControlPlane, path: str, timeout: float = 5.0) -> None:
    """DELETE through the API directly (kubectl's start-up would blur a timing)."""
    access = cp.access
    context = ssl.create_default_context(cafile=str(access.ca_file))
    request = urllib.request.Request(
        access.server + path, method="DELETE", headers={"Authorization": f"Bearer {access.token}"}
    )
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    with opener.open(request, timeout=timeout) as response:
        assert response.status in (200, 202), response.status


def job_path(namespace: str, name: str) -> str:
    return f"/apis/keepstep.dev/v1alpha1/namespaces/{namespace}/trainjobs/{name}"


def get_job(cp: ControlPlane, namespace: str, name: str) -> Any:
    """The TrainJob as the API server has it, or None."""
    return api_get(cp, job_path(namespace, name))


def job_status(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = (get_job(cp, namespace, name) or {}).get("status") or {}
    return status


def job_pods(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    """The pods of a TrainJob (by its label), by name."""
    path = f"/api/v1/namespaces/{namespace}/pods?labelSelector=keepstep.dev/job%3D{name}"
    return {p["metadata"]["name"]: p for p in api_get(cp, path)["items"]}


def node_ready(cp: ControlPlane, node: str) -> str | None:
    """The status of a Node's Ready condition ("True", "False", "Unknown"); None if the
    node or its condition does not exist."""
    obj = api_get(cp, f"/api/v1/nodes/{node}")
    if obj is None:
        return None
    for cond in obj["status"].get("conditions", []):
        if cond["type"] == "Ready":
            return str(cond["status"])
    return None


def apply_crd(cp: ControlPlane) -> None:
    """Apply the TrainJob CRD and wait until it is Established (idempotent)."""
    cp.kubectl("apply", "-f", str(CRD), check=True)
    cp.wait_for_crds(["trainjobs.keepstep.dev"])


class Operator(OperatorProcess):
    """`python -m keepstep.operator` for one namespace, as a process of the test."""

    def __init__(
        self, cp: ControlPlane, etcd: str, namespace: str, log: Path, flags: Sequence[str] = ()
    ) -> None:
        argv = [sys.executable, "-m", "keepstep.operator", "--etcd", etcd]
        argv += ["--kubeconfig", str(cp.kubeconfig), "--namespace", namespace, *flags]
        super().__init__(argv, log)
