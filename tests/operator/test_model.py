"""Parsing what the operator observes: TrainJob specs (validated), pods, settings."""

from __future__ import annotations

import pytest
from op_builders import UID, job, job_object

from keepstep.operator.errors import SpecError
from keepstep.operator.model import Job, Phase, PodPhase, PodView
from keepstep.operator.settings import DecideConfig, OperatorSettings
from keepstep.operator.spec import JobSpec


def test_defaults_fill_optional_fields() -> None:
    obj = job_object()
    trainer = obj["spec"]["trainer"]
    for name in ("args", "numProcPerNode", "seed"):
        del trainer[name]
    del obj["spec"]["elasticPolicy"]["minNodes"]
    spec = Job.from_object(obj).spec
    assert (spec.args, spec.nproc_per_node, spec.seed, spec.min_nodes) == ((), 1, 0, 1)
    assert spec.checkpoint is None and spec.suspend is False


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"globalBatchSize": 63}, "multiple of microBatchSize=4"),
        ({"minNodes": 5}, "minNodes <= maxNodes"),
        ({"globalBatchSize": 8}, "cannot feed maxNodes=4"),
    ],
)
def test_invalid_specs_name_the_field(change: dict[str, int], words: str) -> None:
    obj = job_object()
    obj["spec"]["elasticPolicy"].update(change)
    with pytest.raises(SpecError, match=words):
        Job.from_object(obj)


def test_spec_errors_for_trainer_fields() -> None:
    with pytest.raises(SpecError, match="numSteps=0"):
        job(numSteps=0)
    with pytest.raises(SpecError, match="numNodes='3' must be an integer"):
        job(numNodes="3")
    with pytest.raises(SpecError, match="command"):
        job(command=[])


def test_desired_nodes_follow_num_nodes_capped_at_max() -> None:
    assert job(nodes=3).spec.desired_nodes == 3
    assert job(nodes=9, max_nodes=4).spec.desired_nodes == 4
    assert isinstance(job().spec, JobSpec)


def test_job_key_and_phase() -> None:
    j = job(status={"phase": "Running"})
    assert j.key == "ns.demo" and j.phase is Phase.RUNNING
    assert job(status={"phase": "Bogus"}).phase is None


def _pod(owner_uid: str = UID, **status: object) -> dict[str, object]:
    return {
        "metadata": {
            "name": "demo-node-4",
            "labels": {"keepstep.dev/job": "demo", "keepstep.dev/node-index": "4"},
            "ownerReferences": [{"kind": "TrainJob", "uid": owner_uid, "name": "demo"}],
        },
        "status": status,
    }


def test_pod_views_say_whether_the_job_owns_the_pod() -> None:
    foreign = PodView.from_object(_pod("someone-else"), UID)
    assert foreign is not None and not foreign.owned
    view = PodView.from_object(_pod(), UID)
    assert view == PodView("demo-node-4", 4, PodPhase.PENDING)


def test_pod_running_since_its_container_started() -> None:
    raw = _pod(
        phase="Running",
        startTime="2025-01-01T00:00:00Z",
        containerStatuses=[{"state": {"running": {"startedAt": "2025-01-01T00:00:09Z"}}}],
    )
    view = PodView.from_object(raw, UID)
    assert view is not None and view.phase is PodPhase.RUNNING
    assert view.running_since == 1735689609.0


def test_settings_are_validated() -> None:
    with pytest.raises(SpecError, match="resync_s=0"):
        OperatorSettings(etcd="http://e:2379", resync_s=0)
    with pytest.raises(SpecError, match="peering='x' needs standalone=False"):
        OperatorSettings(etcd="http://e:2379", peering="x")
    config = DecideConfig.of(OperatorSettings(etcd="http://e:2379", lost_pod_grace_s=3))
    assert config.lost_pod_s == 3 and config.etcd == "http://e:2379"
