"""Fake Node objects for kwok: create many at once, count the schedulable ones, remove them.

Where it sits: a scale test or bench/operator_scale.py starts `kwok.Kwok`, then
`KwokNodes.create(n)`; the Node objects carry the annotation that kwok's
--manage-nodes-with-annotation-selector matches, and a label (`keepstep.dev/kwok=<manage>`)
that selects exactly this set. kwok fills their status (Ready, capacity 1k cpu / 1Ti / 1M
pods, addresses) and the node lifecycle controller then lifts the not-ready taint that
admission put on every new Node, so `schedulable()` is what the scheduler sees.

Writes go through `nodeapi.NodeApi` (server-side apply, per-call timeouts), several in
flight at once; reads are one list per call through the admin's `AdminAccess.get`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

from keepstep.e2e.kubeconfig import AdminAccess
from keepstep.e2e.kwok import ANNOTATION
from keepstep.e2e.nodeapi import NodeApi

SET_LABEL = "keepstep.dev/kwok"
# Taints the node lifecycle controller keeps on a node that is not Ready (yet).
_NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def kwok_trainjob(name: str, nodes: int) -> str:
    """A TrainJob manifest (JSON) for pods that kwok plays: nothing ever runs its image, so
    only the numbers matter (``nodes`` pods, minNodes 1)."""
    return json.dumps(
        {
            "apiVersion": "keepstep.dev/v1alpha1",
            "kind": "TrainJob",
            "metadata": {"name": name},
            "spec": {
                "trainer": {
                    "image": "keepstep:dev",
                    "command": ["python", "examples/mlp.py"],
                    "numNodes": nodes,
                    "numSteps": 100,
                },
                "elasticPolicy": {
                    "minNodes": 1,
                    "maxNodes": nodes,
                    "globalBatchSize": nodes,
                    "microBatchSize": 1,
                },
            },
        }
    )


class KwokNodesError(RuntimeError):
    """A Node could not be created or removed, or did not become schedulable in time."""


def node_manifest(name: str, manage: str) -> dict[str, Any]:
    """A Node that the kwok started with `manage` plays; kwok writes its status."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {SET_LABEL: manage, "kubernetes.io/hostname": name, "type": "kwok"},
            "annotations": {ANNOTATION: manage},
        },
    }


def schedulable(node: Mapping[str, Any]) -> bool:
    """Ready and free of the not-ready/unreachable taints: the scheduler may bind to it."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = (node.get("spec") or {}).get("taints") or []
    return ready and not any(t.get("key") in _NOT_READY_TAINTS for t in taints)


class KwokNodes:
    """The fake nodes of one kwok (`manage`): `names` lists those created here."""

    def __init__(
        self,
        kubeconfig: Path,
        access: AdminAccess,
        manage: str,
        *,
        timeout: float = 10.0,
        parallelism: int = 8,
    ) -> None:
        if not 1 <= parallelism <= 32:
            raise ValueError(f"parallelism={parallelism} must be 1..32")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        self.access, self.manage, self.timeout = access, manage, timeout
        self.parallelism = parallelism
        self.names: list[str] = []
        self._api = NodeApi(kubeconfig, timeout)

    def close(self) -> None:
        self._api.close()

    def create(self, count: int, prefix: str) -> list[str]:
        """Create `count` nodes named <prefix>-0 .. <prefix>-<count-1>; returns the names."""
        if count < 1:
            raise ValueError(f"count={count} must be >= 1")
        names = [f"{prefix}-{i}" for i in range(count)]
        self.names += names
        self._each(names, lambda n: self._api.apply_node(node_manifest(n, self.manage)), "create")
        return names

    def list(self) -> list[dict[str, Any]]:
        """This set's Node objects, as the API server has them."""
        selector = quote(f"{SET_LABEL}={self.manage}")
        status, body = self.access.get(f"/api/v1/nodes?labelSelector={selector}", timeout=30.0)
        if status != 200:
            raise KwokNodesError(
                f"listing the nodes of {self.manage!r}: HTTP {status} {body[:200]!r}"
            )
        items: list[dict[str, Any]] = json.loads(body).get("items") or []
        return items

    def schedulable(self) -> int:
        return sum(1 for node in self.list() if schedulable(node))

    def wait_schedulable(self, count: int, *, timeout: float) -> float:
        """Wait until `count` nodes of the set are schedulable; returns the seconds taken."""
        began = time.monotonic()
        seen = 0
        while time.monotonic() - began < timeout:
            seen = self.schedulable()
            if seen >= count:
                return time.monotonic() - began
            time.sleep(0.25)
        raise KwokNodesError(f"{seen} of {count} kwok nodes schedulable after {timeout:g} s")

    def delete(self, names: Sequence[str] | None = None) -> None:
        """Delete the given nodes (default: all created here); their Leases, which the
        nodes own, go with them. Deleting a missing node is not an error."""
        doomed = list(self.names if names is None else names)
        self._each(doomed, self._api.delete_node, "delete")
        gone = set(doomed)
        self.names = [n for n in self.names if n not in gone]

    def _each(self, names: Iterable[str], call: Callable[[str], object], what: str) -> None:
        failures: list[str] = []

        def one(name: str) -> None:
            try:
                call(name)
            except Exception as error:  # any API error: collected and reported together
                failures.append(f"{name}: {error}")

        with ThreadPoolExecutor(self.parallelism, thread_name_prefix="kwok-nodes") as pool:
            list(pool.map(one, names))
        if failures:
            more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
            raise KwokNodesError(f"could not {what} {'; '.join(failures[:3])}{more}")
