"""The pod and Service manifests the operator creates for a TrainJob."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment
from op_builders import ETCD, UID, job, job_object

from keepstep.operator.errors import SpecError
from keepstep.operator.model import Job, Phase
from keepstep.operator.podspec import (
    agent_args,
    agent_metrics_port,
    owner_reference,
    pod_manifest,
    pod_name,
    resumes_from_checkpoint,
    service_manifest,
    shm_size_limit,
)

REPO = Path(__file__).resolve().parents[2]


def test_pod_runs_the_agent_with_the_jobs_shape_then_the_training_command() -> None:
    pod = pod_manifest(job(nodes=3, min_nodes=2), 7, ETCD)
    assert pod["metadata"]["name"] == "demo-node-7" == pod_name("demo", 7)
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "agent" and container["image"] == "keepstep:dev"
    assert container["command"] == ["keepstep", "agent"]
    assert container["args"] == [
        "--nodes", "3", "--min-nodes", "2", "--nproc", "1", "--global-batch", "64",
        "--micro-batch", "4", "--steps", "100", "--seed", "7",
        "--termination-log", "/dev/termination-log",
        "--", "python", "train.py", "--lr", "0.1",
    ]  # fmt: skip
    # Why the agent failed lands in the container's status (or its last log lines).
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


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
    # The spec check refuses the reserved name; a job that got past it (stored before the
    # check existed) still cannot take the job's identity.
    with pytest.raises(SpecError, match=r"spec.trainer.env\[1\].name=KEEPSTEP_JOB is reserved"):
        job(env=env)
    unchecked = job()
    object.__setattr__(unchecked.spec, "env", tuple(env))
    (container,) = pod_manifest(unchecked, 0, ETCD)["spec"]["containers"]
    by_name = {e["name"]: e for e in container["env"]}
    assert by_name["KEEPSTEP_ETCD_ENDPOINTS"]["value"] == ETCD
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


def test_gpus_per_node_are_one_per_worker() -> None:
    gpus = {"limits": {"nvidia.com/gpu": 2}}
    (container,) = pod_manifest(job(resourcesPerNode=gpus, numProcPerNode=2), 0, ETCD)["spec"][
        "containers"
    ]
    assert container["resources"] == gpus  # the device plugin sees the node's GPUs asked for
    assert container["args"][container["args"].index("--nproc") + 1] == "2"
    with pytest.raises(SpecError, match=r"numProcPerNode=1 but .* asks for 2 nvidia.com/gpu"):
        job(resourcesPerNode=gpus, numProcPerNode=1)
    with pytest.raises(SpecError, match=r"requests.nvidia.com/gpu='1500m' must be a whole"):
        job(resourcesPerNode={"requests": {"nvidia.com/gpu": "1500m"}}, numProcPerNode=2)


def test_an_agent_that_serves_prometheus_declares_its_port_by_name() -> None:
    """KEEPSTEP_TELEMETRY=prometheus in trainer.env: the agent's scrape port is the
    container port `metrics` (what a PodMonitor names); 9464 unless the env says."""
    on = [{"name": "KEEPSTEP_TELEMETRY", "value": "otlp, Prometheus"}]
    (container,) = pod_manifest(job(env=on), 0, ETCD)["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9464, "protocol": "TCP"}]
    port = [*on, {"name": "KEEPSTEP_TELEMETRY_PORT", "value": "9100"}]
    (container,) = pod_manifest(job(env=port), 0, ETCD)["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9100, "protocol": "TCP"}]
    # The pod passes through the podTemplate: the port stays.
    obj = job_object(env=on)
    obj["spec"]["podTemplate"] = {"metadata": {"labels": {"team": "a"}}}
    templated = pod_manifest(Job.from_object(obj), 0, ETCD)
    assert templated["metadata"]["labels"]["team"] == "a"
    assert templated["spec"]["containers"][0]["ports"][0]["name"] == "metrics"


@pytest.mark.parametrize(
    "env",
    [
        [],  # telemetry off
        [{"name": "KEEPSTEP_TELEMETRY", "value": "otlp"}],
        [{"name": "KEEPSTEP_TELEMETRY", "value": "none"}],
        # Known only when the pod starts: nothing to declare.
        [{"name": "KEEPSTEP_TELEMETRY", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
        [
            {"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"},
            {"name": "KEEPSTEP_TELEMETRY_PORT", "valueFrom": {"fieldRef": {"fieldPath": "x"}}},
        ],
        # Chosen at start, or a value the agent refuses: no port the API server would refuse.
        [
            {"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"},
            {"name": "KEEPSTEP_TELEMETRY_PORT", "value": "0"},
        ],
        [
            {"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"},
            {"name": "KEEPSTEP_TELEMETRY_PORT", "value": "http"},
        ],
        [
            {"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"},
            {"name": "KEEPSTEP_TELEMETRY_PORT", "value": "70000"},
        ],
    ],
)
def test_no_metrics_port_unless_prometheus_is_on_at_a_known_port(env: list[Any]) -> None:
    j = job(env=env)
    assert agent_metrics_port(j.spec) is None
    (container,) = pod_manifest(j, 0, ETCD)["spec"]["containers"]
    assert "ports" not in container


def test_service_is_headless_selects_the_job_and_is_owned() -> None:
    svc = service_manifest(job())
    assert svc["metadata"]["name"] == "demo"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"keepstep.dev/job": "demo"}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["ownerReferences"][0]["uid"] == UID


# ---------------------------------------------------------------- Pod Security, podTemplate

RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What Pod Security "restricted" (baseline included) would refuse in `pod`: the
    checks of k8s.io/pod-security-admission that a pod like ours can trip."""
    spec = pod["spec"]
    pod_sc = spec.get("securityContext") or {}
    out = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(host)
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {volume['name']}: {sorted(kinds)}")
    if (pod_sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("pod seccompProfile")
    for c in spec["containers"]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append("privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append("allowPrivilegeEscalation != false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append("capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"capabilities.add {caps['add']}")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append("runAsNonRoot != true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append("runAsUser=0")
        if c.get("ports") and any(p.get("hostPort") for p in c["ports"]):
            out.append("hostPort")
    return out


def test_the_pod_passes_pod_security_restricted_with_writable_scratch_space() -> None:
    pod = pod_manifest(job(), 0, ETCD, ["node-a"], resume=False)
    assert restricted_violations(pod) == []
    spec = pod["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # The root file system is read-only: /tmp (the agent's run dir, the workers' temporary
    # files) and /dev/shm (the snapshots, in memory) are emptyDirs.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/tmp"]] == {"name": "keepstep-tmp", "emptyDir": {}}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    assert restricted_violations(dict(pod, spec=dict(spec, hostNetwork=True))) == ["hostNetwork"]


TEMPLATE = {
    "metadata": {"labels": {"team": "vision"}, "annotations": {"cost-center": "42"}},
    "spec": {
        "securityContext": {"runAsUser": 10001, "fsGroup": 10001},
        "containerSecurityContext": {
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}
        },
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
            {"name": "keepstep-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        ],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
        "serviceAccountName": "trainer",
        "automountServiceAccountToken": True,
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "training",
        "schedulerName": "gang",
    },
}  # fmt: skip


def test_a_pod_template_is_laid_over_the_defaults_and_the_operator_keeps_its_own() -> None:
    plain = pod_manifest(job(), 3, ETCD)
    pod = pod_manifest(job_with_template(TEMPLATE), 3, ETCD)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"] == {"team": "vision", **plain["metadata"]["labels"]}
    assert meta["annotations"] == {"cost-center": "42"}
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 10001,
        "fsGroup": 10001,
    }
    for name in ("nodeSelector", "tolerations", "serviceAccountName", "imagePullSecrets",
                 "priorityClassName", "schedulerName"):  # fmt: skip
        assert spec[name] == TEMPLATE["spec"][name], name
    assert spec["automountServiceAccountToken"] is True  # asked for
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert sorted(volumes) == ["data", "keepstep-shm", "keepstep-tmp"]
    assert volumes["keepstep-shm"]["emptyDir"]["sizeLimit"] == "8Gi"  # replaced by name
    (container,) = spec["containers"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/tmp", "/dev/shm", "/data"]
    assert container["securityContext"]["capabilities"]["add"] == ["NET_BIND_SERVICE"]
    assert restricted_violations(pod) == []
    # The operator's own: identity, container, restart policy.
    (plain_container,) = plain["spec"]["containers"]
    for key in ("name", "image", "command", "args", "env"):
        assert container[key] == plain_container[key], key
    assert (meta["name"], meta["ownerReferences"]) == (
        plain["metadata"]["name"],
        plain["metadata"]["ownerReferences"],
    )
    assert (spec["restartPolicy"], spec["subdomain"]) == ("Never", "demo")


def shm_volume(pod: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "keepstep-shm"]
    return dict(volume)


def test_dev_shm_is_sized_from_the_snapshot_the_agents_reported() -> None:
    # Before any report the memory-backed volume is bounded by the pod's memory limit only.
    assert shm_volume(pod_manifest(job(), 0, ETCD))["emptyDir"] == {"medium": "Memory"}
    reported = Job.from_object(job_object(status={"snapshotBytes": 1000 << 20}))
    limit = shm_volume(pod_manifest(reported, 3, ETCD))["emptyDir"]["sizeLimit"]
    assert limit == "1756Mi"  # 1.5 x 1000 Mi + 256 Mi of headroom
    assert shm_size_limit(0) is None and shm_size_limit("12") is None
    # A template's own /dev/shm volume is the user's choice: left as given.
    obj = job_object(status={"snapshotBytes": 1000 << 20})
    obj["spec"]["podTemplate"] = TEMPLATE
    own = shm_volume(pod_manifest(Job.from_object(obj), 3, ETCD))
    assert own["emptyDir"]["sizeLimit"] == "8Gi"


def test_the_transformer_s3_sample_gets_a_dev_shm_its_snapshot_fits_in() -> None:
    """The sample's model (examples/transformer.py with the sample's sizes) keeps its
    parameters and AdamW's two moments in each snapshot: at least 12 bytes a parameter."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from transformer import TinyGPT
    finally:
        sys.path.pop(0)
    obj = yaml.safe_load((REPO / "manifests" / "samples" / "transformer-s3.yaml").read_text())
    args = obj["spec"]["trainer"]["args"]
    sizes = dict(zip(args[::2], (int(a) for a in args[1::2]), strict=True))
    with torch.device("meta"):  # counted, not allocated
        model = TinyGPT(128, sizes["--seq"], sizes["--d-model"], sizes["--layers"], 4)
    n = sum(p.numel() for p in model.parameters())
    assert n > 10_000_000  # the ~11M-parameter benchmark model
    snapshot = 3 * 4 * n
    obj["status"] = {"snapshotBytes": snapshot}
    obj["metadata"].update(namespace="ml", uid=UID)
    limit = shm_volume(pod_manifest(Job.from_object(obj), 0, ETCD))["emptyDir"]["sizeLimit"]
    assert limit.endswith("Mi") and int(limit[:-2]) << 20 >= 1.5 * snapshot


def job_with_template(template: dict[str, Any]) -> Job:
    obj = job_object()
    obj["spec"]["podTemplate"] = template
    return Job.from_object(obj)


BAD_TEMPLATES: list[tuple[dict[str, Any], str]] = [
    ({"metadata": {"labels": {"keepstep.dev/job": "x"}}},
     "spec.podTemplate.metadata.labels: ['keepstep.dev/job'] belong to the operator"),
    ({"spec": {"hostNetwork": True}}, "spec.podTemplate.spec: unknown fields ['hostNetwork']"),
    ({"spec": {"volumeMounts": [{"name": "x", "mountPath": "/x"}]}},
     "spec.podTemplate.spec.volumeMounts[0].name='x' names no volume"),
    ({"spec": {"volumes": [{"name": "x", "emptyDir": {}, "secret": {}}]}},
     "spec.podTemplate.spec.volumes[0] (x) must set exactly one volume source"),
    ({"spec": {"containerSecurityContext": {"runAsUser": 0}}},
     "spec.podTemplate.spec.containerSecurityContext.runAsUser=0 contradicts runAsNonRoot"),
    ({"spec": {"automountServiceAccountToken": "yes"}},
     "spec.podTemplate.spec.automountServiceAccountToken='yes' must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize(("template", "words"), BAD_TEMPLATES)
def test_a_pod_template_that_cannot_work_is_refused_naming_the_field(
    template: dict[str, Any], words: str
) -> None:
    with pytest.raises(SpecError) as refused:
        job_with_template(template)
    assert words in str(refused.value)


def test_root_is_allowed_when_asked_for_explicitly() -> None:
    template = {"spec": {"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}}
    pod = pod_manifest(job_with_template(template), 0, ETCD)
    assert restricted_violations(pod) == ["runAsNonRoot != true", "runAsUser=0"]
