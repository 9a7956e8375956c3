"""The manifests the operator creates for a TrainJob: one pod per node, a headless Service
and a NetworkPolicy.

Where it sits: `decide` calls these pure functions to build `CreatePod`/`EnsureService`/
`EnsureNetworkPolicy` actions; `kube` sends the dicts as they are. Each pod runs the node agent
(`keepstep agent ...`) with the job's settings as flags and its identity in the environment:
KEEPSTEP_ETCD_ENDPOINTS, KEEPSTEP_JOB ("<namespace>.<name>", the job's etcd prefix),
KEEPSTEP_NODE (the pod name) and KEEPSTEP_HOST (the pod IP); then the operator's
defaults (`agent_defaults`, e.g. the cluster's telemetry collector) for the names the job's
trainer.env does not set, then trainer.env. A job resumed after a
suspension adds `--resume <checkpoint URI>` (`resumes_from_checkpoint`). An agent that
serves Prometheus metrics declares their port as the container port `metrics`
(`agent_metrics_port`): the port a PodMonitor scrapes, and the only one the NetworkPolicy
admits from outside the job. Every pod is hardened to pass Pod Security "restricted", with
the job's spec.podTemplate laid over the defaults (`template.PodTemplate.apply`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keepstep.operator.fields import reserved_env
from keepstep.operator.model import GROUP, INDEX_LABEL, JOB_LABEL, KIND, VERSION, Job, Phase
from keepstep.operator.spec import JobSpec

AGENT_COMMAND = ("keepstep", "agent")
CONTAINER = "agent"
MANAGED_BY = "keepstep-operator"
# Set by the operator and never taken from trainer.env: they are the job's identity.
RESERVED_ENV = (
    "KEEPSTEP_ETCD",
    "KEEPSTEP_ETCD_ENDPOINTS",
    "KEEPSTEP_JOB",
    "KEEPSTEP_NODE",
    "KEEPSTEP_HOST",
)


METRICS_PORT = "metrics"  # the name of the agent's Prometheus port
# The agent's own default (keepstep.agent.telemetry.config), which the operator may not import.
TELEMETRY_PORT_DEFAULT = 9464


def pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-node-{index}"


def selector(job_name: str) -> str:
    """The label selector of a job's pods (also status.selector, for /scale)."""
    return f"{JOB_LABEL}={job_name}"


def owner_reference(job: Job) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


TERMINATION_LOG = "/dev/termination-log"


def agent_args(spec: JobSpec, resume: bool = False) -> list[str]:
    """The agent's flags: the job's shape, then `--` and the training command. With
    `resume` (and a checkpoint URI) the agent continues from the newest durable checkpoint
    under the URI, if there is one, instead of from step 0."""
    desired = spec.desired_nodes
    args = [
        "--nodes",
        str(desired),
        "--min-nodes",
        str(min(spec.min_nodes, desired)),
        "--nproc",
        str(spec.nproc_per_node),
        "--global-batch",
        str(spec.global_batch),
        "--micro-batch",
        str(spec.micro_batch),
        "--steps",
        str(spec.num_steps),
        "--seed",
        str(spec.seed),
        # Why a failed agent failed, in its container's status (terminated.message).
        "--termination-log",
        TERMINATION_LOG,
    ]
    if spec.checkpoint is not None:
        args += [
            "--checkpoint",
            spec.checkpoint.uri,
            "--checkpoint-every",
            str(spec.checkpoint.every_steps),
        ]
        if resume:
            args += ["--resume", spec.checkpoint.uri]
    return [*args, "--", *spec.command, *spec.args]


def resumes_from_checkpoint(job: Job, phase: Phase) -> bool:
    """Whether pods created now start from the job's newest durable checkpoint.

    A suspension ends every agent and clears the job's etcd records, so after it the
    durable checkpoint is all that is left of the run. That holds for the pods that form
    the resumed run: the job has a checkpoint URI, was suspended after it had trained
    (status.step and the Suspended condition outlive the suspension; the condition stays,
    False, once it was True), and is Pending again (`phase`, this reconcile's). Once the
    resumed run's agents agreed an epoch (Running), a replacement joins like any new node
    and gets the state from its peers."""
    if job.spec.checkpoint is None or phase is not Phase.PENDING:
        return False
    conditions = job.status.get("conditions") or []
    suspended = any(isinstance(c, Mapping) and c.get("type") == "Suspended" for c in conditions)
    step = job.status.get("step")
    return suspended and isinstance(step, int) and step > 0


def agent_env(
    job: Job, etcd: str, defaults: Sequence[tuple[str, str]] = ()
) -> list[dict[str, Any]]:
    """The identity variables, the `defaults` the job's trainer.env leaves unset (the job
    wins), then trainer.env."""
    env: list[dict[str, Any]] = [
        {"name": "KEEPSTEP_ETCD_ENDPOINTS", "value": etcd},
        {"name": "KEEPSTEP_JOB", "value": job.key},
        {"name": "KEEPSTEP_NODE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KEEPSTEP_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    own = {str(e.get("name")) for e in job.spec.env}
    env += [{"name": name, "value": value} for name, value in defaults if name not in own]
    # The spec check refuses reserved names; a job that got past it still cannot take them.
    env += [dict(e) for e in job.spec.env if not reserved_env(str(e.get("name")))]
    return env


def agent_metrics_port(spec: JobSpec, defaults: Sequence[tuple[str, str]] = ()) -> int | None:
    """The port of the agent's Prometheus endpoint, if its environment (the job's
    trainer.env over the operator's `defaults`) turns it on (KEEPSTEP_TELEMETRY lists
    prometheus; the port is KEEPSTEP_TELEMETRY_PORT, else 9464). None when it is off, when
    either value comes from a valueFrom (unknown until the pod starts), or when the port is
    not 1-65535 (0: chosen at start; the agent refuses the rest)."""
    env: dict[str, Mapping[str, Any]] = {name: {"value": value} for name, value in defaults}
    env |= {str(e.get("name")): e for e in spec.env}  # the last of a name wins, as in a pod
    exporters = env.get("KEEPSTEP_TELEMETRY", {}).get("value")
    if not isinstance(exporters, str):
        return None
    if "prometheus" not in {part.strip().lower() for part in exporters.split(",")}:
        return None
    raw = env.get("KEEPSTEP_TELEMETRY_PORT", {"value": str(TELEMETRY_PORT_DEFAULT)}).get("value")
    try:
        port = int(str(raw))
    except ValueError:
        return None
    return port if 1 <= port <= 65535 else None


def pod_manifest(
    job: Job,
    index: int,
    etcd: str,
    avoid_nodes: Sequence[str] = (),
    *,
    resume: bool = False,
    etcd_tls: bool = False,
    env_defaults: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """The pod of node `index` (indices are never reused within a job); `avoid_nodes`
    are nodes the pod must not be bound to (where the pods it replaces were lost);
    `resume`: its agent starts from the job's newest durable checkpoint; `etcd_tls`: it
    mounts the job's etcd credentials (`etcd_tls_secret`); `env_defaults`: the operator's
    defaults of the agent's environment (`agent_env`). Hardened, with the job's
    podTemplate laid over it."""
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.spec.image,
        "command": list(AGENT_COMMAND),
        "args": agent_args(job.spec, resume),
        "env": agent_env(job, etcd, env_defaults),
        "terminationMessagePath": TERMINATION_LOG,
        # An agent killed before it could write the log: the last lines of its output.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if job.spec.resources:
        container["resources"] = dict(job.spec.resources)
    metrics_port = agent_metrics_port(job.spec, env_defaults)
    if metrics_port is not None:
        port = {"name": METRICS_PORT, "containerPort": metrics_port, "protocol": "TCP"}
        container["ports"] = [port]
    spec: dict[str, Any] = {
        # A failed agent is replaced by a new pod with a new index, never restarted in
        # place: the membership protocol treats a new node as a join.
        "restartPolicy": "Never",
        "subdomain": job.name,
        "containers": [container],
    }
    if avoid_nodes:
        term = {"matchFields": [_not_in("metadata.name", sorted(set(avoid_nodes)))]}
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(job.name, index),
            "namespace": job.namespace,
            "labels": {
                JOB_LABEL: job.name,
                INDEX_LABEL: str(index),
                "app.kubernetes.io/managed-by": MANAGED_BY,
            },
            "ownerReferences": [owner_reference(job)],
        },
        "spec": spec,
    }
    out = job.spec.template.apply(pod, shm_size_limit(job.status.get("snapshotBytes")))
    if etcd_tls:  # after the template: the job's identity is not the template's to change
        _mount_etcd_credentials(out, job)
    return out


ETCD_TLS_VOLUME = "keepstep-etcd-tls"
ETCD_TLS_DIR = "/etc/keepstep/etcd-tls"


def etcd_tls_secret(job: Job) -> str:
    """The Secret that holds the job's etcd client certificate (see `etcd_access`)."""
    return f"{job.name}-etcd-tls"


def _mount_etcd_credentials(pod: dict[str, Any], job: Job) -> None:
    spec = pod["spec"]
    secret = {"secretName": etcd_tls_secret(job), "defaultMode": 0o440}
    spec["volumes"] = [v for v in spec["volumes"] if v.get("name") != ETCD_TLS_VOLUME]
    spec["volumes"].append({"name": ETCD_TLS_VOLUME, "secret": secret})
    container = spec["containers"][0]
    mounts = [m for m in container.get("volumeMounts", ()) if m.get("mountPath") != ETCD_TLS_DIR]
    mounts.append({"name": ETCD_TLS_VOLUME, "mountPath": ETCD_TLS_DIR, "readOnly": True})
    container["volumeMounts"] = mounts
    env = [e for e in container["env"] if e.get("name") != "KEEPSTEP_ETCD_TLS_DIR"]
    container["env"] = [*env, {"name": "KEEPSTEP_ETCD_TLS_DIR", "value": ETCD_TLS_DIR}]


# /dev/shm holds the node's snapshot files. The agents report their size (status
# snapshotBytes, the largest node's); a new pod gets that with room to grow (the optimizer's
# slots appear at the first step, a resumed job may load a larger state) and headroom for
# torch's own shared memory (data-loader workers). Before any report, no sizeLimit: the
# memory-backed volume is bounded by the pod's memory limit.
SHM_MARGIN = 1.5
SHM_HEADROOM_BYTES = 256 << 20


def shm_size_limit(snapshot_bytes: object) -> str | None:
    """The sizeLimit quantity ("<n>Mi") of /dev/shm for snapshots of `snapshot_bytes`."""
    if not isinstance(snapshot_bytes, int) or isinstance(snapshot_bytes, bool):
        return None
    if snapshot_bytes <= 0:
        return None
    wanted = int(snapshot_bytes * SHM_MARGIN) + SHM_HEADROOM_BYTES
    return f"{-(-wanted // (1 << 20))}Mi"


def _not_in(key: str, values: list[str]) -> dict[str, Any]:
    return {"key": key, "operator": "NotIn", "values": values}


def network_policy_manifest(job: Job) -> dict[str, Any]:
    """The NetworkPolicy that lets only the job's own pods reach its pods, on any port, and
    anyone reach their Prometheus port.

    An agent listens for its peers (its process-group store, its liveness probe, the
    workers' gloo connections; the ports are chosen at start, so they are not named
    here) and, when its environment turns it on (the job's trainer.env, or the operator's
    default), for Prometheus on the container port `metrics` (by name: pods that turn it
    on later need no new policy; read-only figures).
    The operator never connects to a pod: every other source and port is refused,
    other jobs' pods in the namespace included. Only ingress: agents reach out to etcd,
    object storage and telemetry. Where the cluster's network plugin does not enforce
    NetworkPolicies the object is inert, and the store's secret key prefix
    (`EpochRecord.token`) is what keeps strangers from steering an epoch."""
    own = {"matchLabels": {JOB_LABEL: job.name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {JOB_LABEL: job.name, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "podSelector": own,
            "policyTypes": ["Ingress"],
            "ingress": [
                # A podSelector without a namespaceSelector: pods of the job's namespace only.
                {"from": [{"podSelector": own}]},
                # No `from`: the scraper runs wherever the cluster's Prometheus does.
                {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
            ],
        },
    }


def service_manifest(job: Job) -> dict[str, Any]:
    """The headless Service that gives each pod a DNS name <pod>.<job>.<namespace>.svc."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {JOB_LABEL: job.name, "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: job.name},
            # Agents look each other up before they are ready.
            "publishNotReadyAddresses": True,
        },
    }
