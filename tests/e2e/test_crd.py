"""The TrainJob CRD and the install manifests against a real kube-apiserver, through the real
kubectl: the CRD is accepted and served, the samples are admitted with their defaults filled
in, every invalid spec is refused with a message that names the values, immutable fields
stay put, `kubectl scale` and the status subresource work, `kubectl get kstj` shows the
columns, and the operator's RBAC, Deployment and etcd StatefulSet pass a server-side dry run.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

from keepstep.e2e.controlplane import ControlPlane

from .helpers import wait_for

pytestmark = pytest.mark.e2e

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
OPERATOR = "system:serviceaccount:keepstep-system:keepstep-operator"
Job = dict[str, Any]


def load(relative: str) -> Job:
    (doc,) = yaml.safe_load_all((MANIFESTS / relative).read_text(encoding="utf-8"))
    job: Job = doc
    return job


@pytest.fixture(scope="module")
def cp(trainjob_crd: ControlPlane) -> ControlPlane:
    """The control plane with the TrainJob CRD applied and Established."""
    return trainjob_crd


def create(cp: ControlPlane, namespace: str, job: Job) -> Any:
    done = cp.kubectl("create", "-n", namespace, "-f", "-", "-o", "json", input=json.dumps(job))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def get(cp: ControlPlane, namespace: str, name: str) -> Any:
    return json.loads(
        cp.kubectl("get", "kstj", name, "-n", namespace, "-o", "json", check=True).stdout
    )


def refused(cp: ControlPlane, namespace: str, job: Job) -> str:
    """kubectl's stderr for a job the API server must refuse; the job must not exist after."""
    done = cp.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(job))
    assert done.returncode != 0, f"accepted: {json.dumps(job['spec'])}"
    name = job["metadata"]["name"]
    missing = cp.kubectl("get", "kstj", name, "-n", namespace, "--ignore-not-found", "-o", "name")
    assert missing.stdout == "", missing.stdout
    return done.stderr


def test_samples_are_admitted_with_defaults_filled_in(cp: ControlPlane, namespace: str) -> None:
    for sample in sorted((MANIFESTS / "samples").glob("*.yaml")):
        done = cp.kubectl("apply", "-n", namespace, "-f", str(sample))
        assert done.returncode == 0, (sample.name, done.stderr)
    spec = get(cp, namespace, "mlp")["spec"]
    assert spec["suspend"] is False
    assert spec["trainer"]["args"] == [] and spec["trainer"]["numProcPerNode"] == 1
    assert spec["trainer"]["seed"] == 0 and spec["elasticPolicy"]["minNodes"] == 1
    assert "checkpoint" not in spec  # optional, and no default of its own
    spec = get(cp, namespace, "transformer")["spec"]
    assert spec["trainer"]["numNodes"] == 3 and spec["elasticPolicy"]["minNodes"] == 2
    assert spec["checkpoint"] == {
        "uri": "file:///var/lib/keepstep/checkpoints/transformer",
        "everySteps": 50,
    }
    env = get(cp, namespace, "transformer-s3")["spec"]["trainer"]["env"]
    # valueFrom is passed through untouched, not pruned.
    assert env[1]["valueFrom"] == {
        "secretKeyRef": {"name": "keepstep-s3", "key": "AWS_ACCESS_KEY_ID"}
    }


def edited(change: Callable[[Job], object]) -> Job:
    job = copy.deepcopy(load("samples/trainjob.yaml"))
    job["metadata"]["name"] = "bad"
    change(job)
    return job


def trainer(**fields: Any) -> Callable[[Job], object]:
    return lambda job: job["spec"]["trainer"].update(fields)


def policy(**fields: Any) -> Callable[[Job], object]:
    return lambda job: job["spec"]["elasticPolicy"].update(fields)


INVALID: list[tuple[str, Callable[[Job], object], str]] = [
    ("min>nodes", trainer(numNodes=1),
     "elasticPolicy.minNodes (2) must be <= trainer.numNodes (1)"),
    ("nodes>max", trainer(numNodes=5),
     "trainer.numNodes (5) must be <= elasticPolicy.maxNodes (4)"),
    ("min>max", policy(minNodes=5, maxNodes=4),
     "elasticPolicy.minNodes (5) must be <= elasticPolicy.maxNodes (4)"),
    ("batch-not-divisible", policy(globalBatchSize=66),
     "elasticPolicy.globalBatchSize (66) must be divisible by elasticPolicy.microBatchSize (4):"
     " the remainder is 2"),
    ("too-few-micro-batches", trainer(numProcPerNode=8),
     "globalBatchSize / microBatchSize (64 / 4 = 16 micro-batches) must be >= maxNodes *"
     " numProcPerNode (4 * 8 = 32 workers)"),
    ("missing-numSteps", lambda job: job["spec"]["trainer"].pop("numSteps"),
     "spec.trainer.numSteps: Required value"),
    ("missing-elasticPolicy", lambda job: job["spec"].pop("elasticPolicy"),
     "spec.elasticPolicy: Required value"),
    ("empty-command", trainer(command=[]),
     "spec.trainer.command in body should have at least 1 items"),
    ("nproc>64", trainer(numProcPerNode=65),
     "spec.trainer.numProcPerNode in body should be less than or equal to 64"),
    ("checkpoint-without-scheme", lambda job: job["spec"]["checkpoint"].update(uri="/ckpt"),
     "checkpoint.uri (/ckpt) must be a URL with a scheme"),
    ("env-value-and-valueFrom",
     trainer(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
     "env A: set value or valueFrom, not both"),
    ("name-not-a-dns-label", lambda job: job["metadata"].update(name="9lives"),
     "metadata.name (9lives) must start with a letter"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_spec_is_refused_with_a_message_naming_the_values(
    cp: ControlPlane, namespace: str, change: Callable[[Job], object], message: str
) -> None:
    assert message in refused(cp, namespace, edited(change))


# field path -> a new value; the old one is the main sample's.
IMMUTABLE: dict[tuple[str, str], Any] = {
    ("trainer", "image"): "keepstep/agent:0.2.0",
    ("trainer", "command"): ["python", "examples/mlp.py"],
    ("trainer", "args"): [],
    ("trainer", "numProcPerNode"): 1,
    ("trainer", "numSteps"): 300,
    ("trainer", "seed"): 1,
    ("elasticPolicy", "globalBatchSize"): 128,
    ("elasticPolicy", "microBatchSize"): 8,
}


def test_immutable_fields_cannot_change_and_the_others_can(
    cp: ControlPlane, namespace: str
) -> None:
    sample = load("samples/trainjob.yaml")
    create(cp, namespace, sample)
    for (group, field), new in IMMUTABLE.items():
        patch = json.dumps({"spec": {group: {field: new}}})
        done = cp.kubectl(
            "patch", "kstj", "transformer", "-n", namespace, "--type=merge", "-p", patch
        )
        assert done.returncode != 0, f"{group}.{field} changed to {new!r}"
        old = sample["spec"][group][field]
        expected = f"{group}.{field} is immutable (was "
        if isinstance(old, int):
            expected += f"{old}, now {new})"
        assert expected in done.stderr, done.stderr
    assert get(cp, namespace, "transformer")["spec"]["trainer"]["seed"] == 0
    mutable = {
        "suspend": True,
        "trainer": {"numNodes": 2, "env": [{"name": "LOG_LEVEL", "value": "debug"}]},
        "elasticPolicy": {"minNodes": 1, "maxNodes": 3},
        "checkpoint": {"everySteps": 10},
    }
    cp.kubectl(
        "patch", "kstj", "transformer", "-n", namespace, "--type=merge", "-p",
        json.dumps({"spec": mutable}), check=True,
    )  # fmt: skip
    spec = get(cp, namespace, "transformer")["spec"]
    assert (spec["suspend"], spec["trainer"]["numNodes"], spec["elasticPolicy"]["maxNodes"]) == (
        True,
        2,
        3,
    )


def test_scale_sets_num_nodes_within_the_elastic_range(cp: ControlPlane, namespace: str) -> None:
    create(cp, namespace, load("samples/trainjob.yaml"))
    done = cp.kubectl("scale", "trainjob/transformer", "-n", namespace, "--replicas=4")
    assert done.returncode == 0, done.stderr
    assert get(cp, namespace, "transformer")["spec"]["trainer"]["numNodes"] == 4
    done = cp.kubectl("scale", "kstj/transformer", "-n", namespace, "--replicas=5")
    assert "trainer.numNodes (5) must be <= elasticPolicy.maxNodes (4)" in done.stderr
    done = cp.kubectl("scale", "kstj/transformer", "-n", namespace, "--replicas=1")
    assert "elasticPolicy.minNodes (2) must be <= trainer.numNodes (1)" in done.stderr
    assert get(cp, namespace, "transformer")["spec"]["trainer"]["numNodes"] == 4


STATUS = {
    "phase": "Running",
    "nodes": 3,
    "worldSize": 6,
    "step": 42,
    "epoch": 2,
    "recoveries": 1,
    "lastMttrSeconds": 0.37,
    "mttrP50Seconds": 0.41,
    "selector": "keepstep.dev/job=transformer",
    "nextPodIndex": 4,
    "conditions": [
        {"type": "Ready", "status": "True", "reason": "Training", "message": "3 of 3 nodes",
         "lastTransitionTime": "2026-01-01T00:00:00Z"},
    ],
}  # fmt: skip


def patch_status(cp: ControlPlane, namespace: str, status: Job) -> Any:
    return cp.kubectl(
        "patch", "kstj", "transformer", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def test_status_subresource_takes_status_and_only_status(cp: ControlPlane, namespace: str) -> None:
    create(cp, namespace, load("samples/trainjob.yaml"))
    done = patch_status(cp, namespace, STATUS)
    assert done.returncode == 0, done.stderr
    job = get(cp, namespace, "transformer")
    assert job["status"] == STATUS
    # Through /status the spec does not change; through the main resource the status does not.
    cp.kubectl(
        "patch", "kstj", "transformer", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", '{"spec": {"trainer": {"numNodes": 4}}}', check=True,
    )  # fmt: skip
    cp.kubectl(
        "patch", "kstj", "transformer", "-n", namespace, "--type=merge",
        "-p", '{"status": {"step": 0}}', check=True,
    )  # fmt: skip
    job = get(cp, namespace, "transformer")
    assert (job["spec"]["trainer"]["numNodes"], job["status"]["step"]) == (3, 42)
    done = patch_status(cp, namespace, {"phase": "Exploded"})
    assert 'status.phase: Unsupported value: "Exploded"' in done.stderr
    scale = json.loads(
        cp.kubectl(
            "get", "--raw", f"/apis/keepstep.dev/v1alpha1/namespaces/{namespace}"
            "/trainjobs/transformer/scale", check=True,
        ).stdout
    )  # fmt: skip
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)
    assert scale["status"]["selector"] == "keepstep.dev/job=transformer"


def test_get_kstj_shows_the_printer_columns(cp: ControlPlane, namespace: str) -> None:
    create(cp, namespace, load("samples/trainjob.yaml"))
    assert patch_status(cp, namespace, STATUS).returncode == 0
    table = cp.kubectl("get", "kstj", "-n", namespace, check=True).stdout.split("\n")
    assert table[0].split() == ["NAME", "NODES", "STEP", "PHASE", "MTTR", "AGE"]
    assert table[1].split()[:5] == ["transformer", "3", "42", "Running", "0.37"]
    wide = cp.kubectl("get", "kstj", "-n", namespace, "-o", "wide", check=True).stdout.split("\n")
    assert wide[0].split()[6:] == ["DESIRED", "WORLD", "EPOCH", "RECOVERIES"]
    assert wide[1].split()[6:] == ["3", "6", "2", "1"]
    everything = cp.kubectl("get", "all", "-n", namespace, "-o", "name", check=True).stdout
    assert "trainjob.keepstep.dev/transformer" in everything.split()


# Another project's TrainJob: the same kind in another group, with the short name "tj".
OTHER_TRAINJOB_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "trainjobs.trainer.example.org"},
    "spec": {
        "group": "trainer.example.org",
        "scope": "Namespaced",
        "names": {"kind": "TrainJob", "plural": "trainjobs", "singular": "trainjob",
                  "listKind": "TrainJobList", "shortNames": ["tj"]},
        "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
            "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        }}],
    },
}  # fmt: skip


def test_the_crd_lives_beside_another_trainjob_kind(cp: ControlPlane, namespace: str) -> None:
    """Installed beside another TrainJob CRD (Kubeflow Trainer's is one), keepstep's jobs are
    reached by their full name and by a short name that is theirs alone."""
    crd = json.dumps(OTHER_TRAINJOB_CRD)
    cp.kubectl("apply", "-f", "-", input=crd, check=True)
    try:
        cp.wait_for_crds(["trainjobs.trainer.example.org"])
        create(cp, namespace, load("samples/trainjob.yaml"))
        other = {"apiVersion": "trainer.example.org/v1", "kind": "TrainJob",
                 "metadata": {"name": "theirs"}}  # fmt: skip
        cp.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(other), check=True)

        def names(resource: str) -> list[str]:
            out = cp.kubectl("get", resource, "-n", namespace, "-o", "name", check=True).stdout
            return out.split()

        ours = ["trainjob.keepstep.dev/transformer"]
        assert names("trainjobs.keepstep.dev") == names("kstj") == ours
        assert names("trainjobs.trainer.example.org") == ["trainjob.trainer.example.org/theirs"]
    finally:
        cp.kubectl("delete", "-f", "-", "--wait=false", input=crd)


def test_install_manifests_pass_a_server_side_dry_run(cp: ControlPlane) -> None:
    cp.kubectl("apply", "-f", str(MANIFESTS / "namespace.yaml"), check=True)
    files = [("rbac.yaml", 2), ("user-roles.yaml", 2), ("operator.yaml", 2), ("etcd.yaml", 4)]
    files.append(("namespaced/operator.yaml", 4))
    for file, objects in files:
        done = cp.kubectl("apply", "--dry-run=server", "-f", str(MANIFESTS / file))
        assert done.returncode == 0, (file, done.stderr)
        assert done.stdout.count("(server dry run)") == objects, done.stdout
        # The namespace warns on anything Pod Security `restricted` would refuse.
        assert "Warning" not in done.stderr, (file, done.stderr)


def can_i(cp: ControlPlane, who: str, namespace: str) -> dict[str, set[str]]:
    """resource -> verbs that `who` may use in `namespace`, as the RBAC authorizer says."""
    out = cp.kubectl("auth", "can-i", "--list", f"--as={who}", "-n", namespace, check=True)
    granted: dict[str, set[str]] = {}
    for line in out.stdout.splitlines()[1:]:
        resource, rest = line.split(maxsplit=1)
        verbs = rest[rest.rindex("[") + 1 : rest.rindex("]")].split()
        granted.setdefault(resource, set()).update(verbs)
    return granted


OPERATOR_CAN = {
    "trainjobs.keepstep.dev": {"get", "list", "watch", "patch"},
    "trainjobs.keepstep.dev/status": {"patch"},
    "pods": {"create", "delete", "list", "watch"},
    "services": {"create", "get"},
    "networkpolicies.networking.k8s.io": {"create", "get"},
    "events": {"create"},
    "secrets": {"create", "get"},
    "customresourcedefinitions.apiextensions.k8s.io": {"list", "watch"},
}


def test_rbac_grants_the_operator_exactly_its_verbs(cp: ControlPlane, namespace: str) -> None:
    cp.kubectl("apply", "-f", str(MANIFESTS / "rbac.yaml"), check=True)
    cp.kubectl("apply", "-f", str(MANIFESTS / "user-roles.yaml"), check=True)

    def operator_granted() -> bool:
        granted = can_i(cp, OPERATOR, namespace)
        # Every authenticated user may create self-reviews and read discovery URLs ([/api]
        # and the like); nothing else beyond the list may be granted.
        own = {k: v for k, v in granted.items() if not k.startswith(("self", "["))}
        return own == OPERATOR_CAN

    wait_for("the operator's RBAC to take effect", operator_granted, 20.0, every=0.3)
    # A namespace's `edit` users get TrainJobs through aggregation, but not their status.
    cp.kubectl(
        "create", "rolebinding", "dev-edit", "--clusterrole=edit", "--user=dev", "-n", namespace,
        check=True,
    )  # fmt: skip

    def developer_may_run_jobs() -> bool:
        granted = can_i(cp, "dev", namespace)
        return {"create", "delete", "patch"} <= granted.get("trainjobs.keepstep.dev", set())

    wait_for("edit to aggregate the TrainJob role", developer_may_run_jobs, 20.0, every=0.3)
    granted = can_i(cp, "dev", namespace)
    assert granted["trainjobs.keepstep.dev/status"] <= {"get", "list", "watch"}
    assert {"patch", "update"} <= granted["trainjobs.keepstep.dev/scale"]
