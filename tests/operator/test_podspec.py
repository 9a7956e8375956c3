"""The pod and Service manifests the operator creates for a TrainJob."""

from __future__ import annotations

from typing import Any

import pytest
from op_builders import ETCD, UID, job

from keepstep.operator.model import Phase
from keepstep.operator.podspec import (
    agent_args,
    owner_reference,
    pod_manifest,
    pod_name,
    resumes_from_checkpoint,
    service_manifest,
)


def test_pod_runs_the_agent_with_the_jobs_shape_then_the_training_command() -> None:
    pod = pod_manifest(job(nodes=3, min_nodes=2), 7, ETCD)
    assert pod["metadata"]["name"] == "demo-node-7" == pod_name("demo", 7)
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "agent" and container["image"] == "keepstep:dev"
    assert container["command"] == ["keepstep", "agent"]
    assert container["args"] == [
        "--nodes", "3", "--min-nodes", "2", "--nproc", "1", "--global-batch", "64",
        "--micro-batch", "4", "--steps", "100", "--seed", "7",
        "--", "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip


def test_checkpoint_flags_come_before_the_separator() -> None:
    args = agent_args(job(checkpoint={"uri": "s3://b/j", "everySteps": 25}).spec)
    sep = args.index("--")
    assert args[sep - 4 : sep] == ["--checkpoint", "s3://b/j", "--checkpoint-every", "25"]
    assert "--checkpoint" not in agent_args(job().spec)


def test_resume_names_the_checkpoint_uri_before_the_separator() -> None:
    spec = job(checkpoint={"uri": "file:///ckpt/demo", "everySteps": 5}).spec
    args = agent_args(spec, resume=True)
    sep = args.index("--")
    assert args[sep - 2 : sep] == ["--resume", "file:///ckpt/demo"]
    assert args[sep:] == agent_args(spec)[agent_args(spec).index("--") :]
    assert "--resume" not in agent_args(spec)
    # Nothing to resume from without a checkpoint URI.
    assert "--resume" not in agent_args(job().spec, resume=True)
    (container,) = pod_manifest(job(checkpoint={"uri": "file:///c"}), 1, ETCD, resume=True)["spec"][
        "containers"
    ]
    assert container["args"][container["args"].index("--resume") + 1] == "file:///c"


SUSPENDED_ONCE = [{"type": "Suspended", "status": "False"}]


@pytest.mark.parametrize(
    ("checkpoint", "status", "phase", "resumes"),
    [
        ({"uri": "file:///c"}, {"step": 30, "conditions": SUSPENDED_ONCE}, Phase.PENDING, True),
        (None, {"step": 30, "conditions": SUSPENDED_ONCE}, Phase.PENDING, False),
        ({"uri": "file:///c"}, {"step": 0, "conditions": SUSPENDED_ONCE}, Phase.PENDING, False),
        ({"uri": "file:///c"}, {"step": 30}, Phase.PENDING, False),  # never suspended
        ({"uri": "file:///c"}, {"step": 30, "conditions": SUSPENDED_ONCE}, Phase.RUNNING, False),
    ],
)
def test_which_pods_resume_from_the_checkpoint(
    checkpoint: dict[str, Any] | None, status: dict[str, Any], phase: Phase, resumes: bool
) -> None:
    assert resumes_from_checkpoint(job(checkpoint=checkpoint, status=status), phase) is resumes


def test_pod_identity_labels_owner_and_restart_policy() -> None:
    pod = pod_manifest(job(), 2, ETCD)
    meta = pod["metadata"]
    assert meta["namespace"] == "ns"
    assert meta["labels"]["keepstep.dev/job"] == "demo"
    assert meta["labels"]["keepstep.dev/node-index"] == "2"
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "keepstep.dev/v1alpha1",
        "kind": "TrainJob",
        "name": "demo",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert owner == owner_reference(job())
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["subdomain"] == "demo"


def test_env_carries_etcd_job_node_and_host_and_the_trainer_env() -> None:
    env = [
        {"name": "LR", "value": "0.1"},
        {"name": "KEEPSTEP_JOB", "value": "hijack"},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    (container,) = pod_manifest(job(env=env), 0, ETCD)["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name["KEEPSTEP_ETCD"]["value"] == ETCD
    assert by_name["KEEPSTEP_JOB"]["value"] == "ns.demo"  # the job's identity is not overridable
    assert [e["name"] for e in container["env"]].count("KEEPSTEP_JOB") == 1
    assert by_name["KEEPSTEP_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert by_name["KEEPSTEP_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert by_name["LR"]["value"] == "0.1"
    assert by_name["POD_NS"] == env[2]


def test_resources_per_node_go_to_the_container() -> None:
    resources = {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}
    (container,) = pod_manifest(job(resourcesPerNode=resources), 0, ETCD)["spec"]["containers"]
    assert container["resources"] == resources
    (plain,) = pod_manifest(job(), 0, ETCD)["spec"]["containers"]
    assert "resources" not in plain


def test_service_is_headless_selects_the_job_and_is_owned() -> None:
    svc = service_manifest(job())
    assert svc["metadata"]["name"] == "demo"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"keepstep.dev/job": "demo"}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == UID
