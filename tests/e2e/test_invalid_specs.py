"""The thirty-one invalid TrainJobs of tests/manifests/invalid_trainjobs.yaml against the real
kube-apiserver with the TrainJob CRD: every case the table says the API server refuses is
refused (422) with a message naming the field; every case it leaves to the operator is
admitted, so the table says truly where each mistake is caught (the operator's side:
tests/operator/test_invalid_specs.py).

Each case is one server-side dry-run create over HTTPS (no kubectl process, nothing
stored): the thirty-one take about a second together.
"""

from __future__ import annotations

import copy
import json
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

from keepstep.e2e.controlplane import ControlPlane

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tests" / "manifests" / "invalid_trainjobs.yaml"
SAMPLE = REPO / "manifests" / "samples" / "trainjob.yaml"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def dry_run_create(cp: ControlPlane, namespace: str, job: Any) -> tuple[int, dict[str, Any]]:
    """POST the TrainJob with dryRun=All: (HTTP status, the answer: the object or a Status)."""
    access = cp.access
    path = f"/apis/keepstep.dev/v1alpha1/namespaces/{namespace}/trainjobs?dryRun=All"
    request = urllib.request.Request(
        access.server + path,
        data=json.dumps(job).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {access.token}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=str(access.ca_file))),
    )
    try:
        with opener.open(request, timeout=10.0) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return int(err.code), json.loads(err.read())


def test_every_invalid_spec_is_refused_naming_the_field_or_left_to_the_operator(
    trainjob_crd: ControlPlane, namespace: str
) -> None:
    cases: list[dict[str, Any]] = yaml.safe_load(TABLE.read_text(encoding="utf-8"))
    sample = yaml.safe_load(SAMPLE.read_text(encoding="utf-8"))
    assert len(cases) == 31
    code, _ = dry_run_create(trainjob_crd, namespace, sample)
    assert code == 201, "the base of every case must itself be admitted"
    started = time.monotonic()
    wrong: list[str] = []
    for case in cases:
        code, answer = dry_run_create(trainjob_crd, namespace, merge_patch(sample, case["patch"]))
        message = str(answer.get("message", "")) if code >= 300 else ""
        if case["refused_by"] == "api":
            if code != 422 or case["field"] not in message:
                wrong.append(f"{case['id']}: HTTP {code}, field {case['field']} in {message!r}?")
        elif code != 201:
            wrong.append(f"{case['id']}: the operator's case was refused: {code} {message}")
    took = time.monotonic() - started
    assert not wrong, "\n".join(wrong)
    print(f"\n31 invalid TrainJobs judged in {took:.2f} s")
    assert took < 30.0
