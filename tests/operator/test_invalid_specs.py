"""The thirty-one invalid TrainJobs of tests/manifests/invalid_trainjobs.yaml, as the operator
sees them: what the API server cannot refuse fails the job in the first reconcile, with the
condition InvalidSpec naming the field and no pod created; what it refuses, the operator
refuses as well (a job stored under an older CRD), naming the same field.

tests/e2e/test_invalid_specs.py sends the same table to a real API server.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment
from fake_kube import FakeKube
from op_builders import ETCD, T0, UID

from keepstep.agent.kv.memory import MemoryKV
from keepstep.operator.agents import AgentStore
from keepstep.operator.errors import SpecError
from keepstep.operator.model import Job
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import DecideConfig

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tests" / "manifests" / "invalid_trainjobs.yaml"
SAMPLE = REPO / "manifests" / "samples" / "trainjob.yaml"
CASES: list[dict[str, Any]] = yaml.safe_load(TABLE.read_text(encoding="utf-8"))
# The API server's rules the operator deliberately does not repeat: it follows a job that
# got past them in a defined way instead of failing it.
TOLERATED = {
    "num-nodes-above-max-nodes": "the operator runs min(numNodes, maxNodes) pods",
    "num-nodes-below-min-nodes": "the operator requires min(minNodes, numNodes) live agents",
}


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


def invalid_job(case: dict[str, Any]) -> dict[str, Any]:
    """The sample with the case's patch, as the API server would hand it to the operator."""
    job: dict[str, Any] = merge_patch(
        yaml.safe_load(SAMPLE.read_text(encoding="utf-8")), case["patch"]
    )
    job["metadata"].update(namespace="ns", uid=UID, generation=1)
    return job


def ids(cases: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for c in cases]


OPERATOR = [c for c in CASES if c["refused_by"] == "operator"]
API = [c for c in CASES if c["refused_by"] == "api" and c["id"] not in TOLERATED]


def test_the_table_holds_thirty_one_distinct_cases_over_a_valid_sample() -> None:
    assert len(CASES) == 31 and len(set(ids(CASES))) == 31
    assert {c["refused_by"] for c in CASES} == {"api", "operator"}
    assert set(TOLERATED) <= set(ids(CASES))
    Job.from_object(invalid_job({"patch": {}}))  # the base itself is valid


@pytest.mark.parametrize("case", OPERATOR, ids=ids(OPERATOR))
def test_what_the_api_server_admits_fails_in_one_reconcile_naming_the_field(
    case: dict[str, Any],
) -> None:
    kube = FakeKube()
    job = invalid_job(case)
    name = job["metadata"]["name"]
    kube.jobs[name] = job
    reconciler = Reconciler(kube, AgentStore(MemoryKV(), 0.5), DecideConfig(ETCD), clock=lambda: T0)
    outcome = reconciler.reconcile("ns", name)
    status = kube.jobs[name]["status"]
    assert status["phase"] == "Failed"
    (failed,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "InvalidSpec")
    assert case["field"] in failed["message"], failed["message"]
    assert not kube.pods and not kube.services  # never a job that runs differently
    (event,) = kube.events
    assert event.reason == "InvalidSpec" and case["field"] in event.message
    # Level-triggered: the next reconcile finds it Failed already and writes nothing.
    assert reconciler.reconcile("ns", name).decision.actions == ()
    assert case["field"] in outcome.decision.reason


@pytest.mark.parametrize("case", API, ids=ids(API))
def test_what_the_api_server_refuses_the_operator_refuses_too(case: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as refused:
        Job.from_object(invalid_job(case))
    assert case["field"] in str(refused.value), str(refused.value)


@pytest.mark.parametrize("path", sorted((REPO / "manifests" / "samples").glob("*.yaml")))
def test_every_sample_is_a_job_the_operator_runs(path: Path) -> None:
    obj = yaml.safe_load(path.read_text(encoding="utf-8"))
    obj["metadata"].update(namespace="ns", uid=UID)
    Job.from_object(obj)
