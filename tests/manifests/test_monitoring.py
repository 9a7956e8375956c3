"""manifests/monitoring/: the PodMonitors select the pods that really serve metrics, on a
port those pods really name, without an API server or the Prometheus operator.

- The operator's PodMonitor selects the Deployment's pods (both installs) in their
  namespace, on the container port that --metrics listens on, at its path.
- The agents' PodMonitor selects the pods the operator creates for a TrainJob (the sample
  that turns Prometheus on) and nothing else of the install; their agent container names
  the port, it is the agent's own default, and the job's NetworkPolicy admits it.
- The kustomization lists exactly the PodMonitors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
from openapi_check import MANIFESTS, load_all

from keepstep.agent.telemetry.config import TelemetryConfig
from keepstep.operator.model import Job
from keepstep.operator.podspec import (
    TELEMETRY_PORT_DEFAULT,
    network_policy_manifest,
    pod_manifest,
)
from keepstep.operator.settings import Endpoint

MONITORING = MANIFESTS / "monitoring"


def monitor(name: str) -> dict[str, Any]:
    (doc,) = load_all(MONITORING / f"podmonitor-{name}.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    return doc


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if not selector:
        return False  # an empty selector in a PodMonitor would take every pod: never ours
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for term in selector.get("matchExpressions", []):
        key, op, values = term["key"], term["operator"], term.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def pods_of(file: str) -> list[dict[str, Any]]:
    """The pod templates of a file's workloads."""
    docs = load_all(MANIFESTS / file)
    return [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def sample_job(namespace: str = "team-a") -> Job:
    (obj,) = load_all(MANIFESTS / "samples" / "trainjob.yaml")
    obj = copy.deepcopy(obj)
    obj["metadata"].update(namespace=namespace, uid="uid-1", generation=1)
    return Job.from_object(obj)


@pytest.mark.parametrize("file", ["operator.yaml", "namespaced/operator.yaml"])
def test_the_operator_monitor_scrapes_the_deployments_metrics_port(file: str) -> None:
    pm = monitor("operator")
    (deployment,) = [d for d in load_all(MANIFESTS / file) if d["kind"] == "Deployment"]
    assert pm["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert "namespaceSelector" not in pm["spec"]  # its own namespace only
    template = deployment["spec"]["template"]
    assert selects(pm["spec"]["selector"], template["metadata"]["labels"])
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    served = Endpoint.parse("metrics", args[args.index("--metrics") + 1])
    assert ports[endpoint["port"]] == served.port
    assert endpoint["path"] == served.path


def test_the_operator_monitor_selects_no_other_pod_of_the_install() -> None:
    pm = monitor("operator")
    agent = pod_manifest(sample_job(), 0, "http://etcd:2379")
    others = [*pods_of("etcd.yaml"), agent]
    for pod in others:
        assert not selects(pm["spec"]["selector"], pod["metadata"]["labels"])


def test_the_agents_monitor_scrapes_the_pods_the_operator_creates() -> None:
    pm = monitor("agents")
    assert pm["spec"]["namespaceSelector"] == {"any": True}  # jobs live in users' namespaces
    job = sample_job()
    pod = pod_manifest(job, 3, "http://etcd:2379")
    assert selects(pm["spec"]["selector"], pod["metadata"]["labels"])
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # The agent's own default (keepstep.agent.telemetry), which the operator cannot import.
    assert ports[endpoint["port"]] == TELEMETRY_PORT_DEFAULT == TelemetryConfig().port
    assert endpoint["path"] == "/metrics"
    # The job's NetworkPolicy lets the scraper in on that port (by its name).
    ingress = network_policy_manifest(job)["spec"]["ingress"]
    assert {"ports": [{"protocol": "TCP", "port": endpoint["port"]}]} in ingress
    # Nothing else of the install is taken for an agent.
    for other in (*pods_of("operator.yaml"), *pods_of("etcd.yaml")):
        assert not selects(pm["spec"]["selector"], other["metadata"]["labels"])


def test_the_kustomization_lists_the_monitors_and_nothing_else() -> None:
    (kustomization,) = load_all(MONITORING / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    files = sorted(p.name for p in MONITORING.glob("podmonitor-*.yaml"))
    assert (
        sorted(kustomization["resources"])
        == files
        == [
            "podmonitor-agents.yaml",
            "podmonitor-operator.yaml",
        ]
    )
