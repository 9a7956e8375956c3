"""The dashboard's view of a cluster: TrainJobs listed through the Kubernetes API.

`KubeTrainJobs` is the only dashboard code that talks to Kubernetes (what
`kubectl get trainjobs -A -o json` does: a cluster-wide list of the custom resource);
`FakeTrainJobs` stands in for it in tests, and `trainjob_rows` (pure) turns the objects
into the table the page shows. Status fields are read leniently, under the names the
CRD declares (manifests/crd/trainjob.yaml: `phase`, `nodes`, `worldSize`, `epoch`,
`step`, `samplesPerSecond`, `recoveries`, `lastMttrSeconds`), and `status` is passed
through whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from keepstep.errors import KeepstepError

GROUP, VERSION, PLURAL = "keepstep.dev", "v1alpha1", "trainjobs"


class TrainJobsError(KeepstepError):
    """The Kubernetes API could not be asked, or refused to list TrainJobs."""


class TrainJobSource(Protocol):
    def list(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every TrainJob object in the cluster, as the API returns it."""
        ...


@dataclass
class FakeTrainJobs:
    items: list[dict[str, Any]]

    def list(self, timeout_s: float) -> list[dict[str, Any]]:
        return [dict(item) for item in self.items]


class KubeTrainJobs:
    def __init__(self, kubeconfig: Path, context: str | None = None) -> None:
        import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment
        from kubernetes import client, config

        try:
            api_client = config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), context=context
            )
        except (config.ConfigException, OSError, yaml.YAMLError) as error:
            raise TrainJobsError(f"kubeconfig {kubeconfig}: {error}") from None
        self._api = client.CustomObjectsApi(api_client)
        self._close = api_client.close

    def list(self, timeout_s: float) -> list[dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            answer = self._api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL, _request_timeout=timeout_s
            )
        except ApiException as error:
            raise TrainJobsError(
                f"listing {PLURAL}.{GROUP}/{VERSION}: {error.status} {error.reason}"
            ) from None
        except HTTPError as error:
            raise TrainJobsError(f"listing {PLURAL}.{GROUP}: {error}") from None
        items = answer.get("items", []) if isinstance(answer, dict) else []
        return [dict(item) for item in items]

    def close(self) -> None:
        self._close()


def trainjob_rows(objects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per TrainJob, sorted by namespace and name."""
    rows = []
    for obj in objects:
        meta = obj.get("metadata", {})
        spec = obj.get("spec", {})
        status = obj.get("status", {}) or {}
        trainer = spec.get("trainer", {})
        elastic = spec.get("elasticPolicy", {})
        rows.append(
            {
                "namespace": meta.get("namespace", ""),
                "name": meta.get("name", ""),
                "created": meta.get("creationTimestamp"),
                "nodes": trainer.get("numNodes"),
                "live_nodes": status.get("nodes"),
                "min_nodes": elastic.get("minNodes"),
                "max_nodes": elastic.get("maxNodes"),
                "global_batch": elastic.get("globalBatchSize"),
                "phase": status.get("phase") or _condition(status),
                "world_size": status.get("worldSize"),
                "epoch": status.get("epoch"),
                "step": status.get("step"),
                "steps_total": trainer.get("numSteps"),
                "samples_per_s": status.get("samplesPerSecond"),
                "recoveries": status.get("recoveries"),
                "mttr_s": status.get("lastMttrSeconds"),
                "status": status,
            }
        )
    return sorted(rows, key=lambda r: (r["namespace"], r["name"]))


def _condition(status: Mapping[str, Any]) -> str | None:
    """The type of the newest true condition, for operators that publish no phase."""
    true = [c for c in status.get("conditions", []) or [] if c.get("status") == "True"]
    if not true:
        return None
    return str(max(true, key=lambda c: str(c.get("lastTransitionTime", ""))).get("type"))
