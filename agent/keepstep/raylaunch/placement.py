"""Connecting to Ray, the job's STRICT_SPREAD placement group, and creating node actors.

Where it sits: `launcher.RayLauncher` calls `connect` once, `place` once (one bundle per
node the job starts with, at most one per Ray node), `create_actor` for every node and
replacement, and `place_one` for a node added when the cluster has grown. Replacing a
lost node reuses its bundle: when its Ray node died, Ray places the bundle again on a
node that keeps the group spread, once one has room.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from keepstep.errors import KeepstepError
from keepstep.raylaunch.actor import NodeActor

BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` unless this process already has; returns whether
    this call connected (so the caller disconnects)."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return True


def eligible_nodes(bundle: Mapping[str, float]) -> list[str]:
    """The alive Ray nodes that could hold one bundle (by their total resources)."""
    out = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        total = node.get("Resources", {})
        if node.get("Alive") and all(total.get(k, 0.0) >= v for k, v in bundle.items()):
            out.append(str(node["NodeID"]))
    return out


def place(
    bundle: Mapping[str, float], *, nodes: int, min_nodes: int, timeout: float
) -> PlacementGroup:
    """A placement group of one bundle per node, on distinct Ray nodes: `nodes`, or as many
    as the cluster has room for, but at least `min_nodes`."""
    found = len(eligible_nodes(bundle))
    size = min(nodes, found)
    if size < min_nodes:
        raise KeepstepError(
            f"the Ray cluster has {found} nodes with {dict(bundle)}; the job needs at least "
            f"--min-nodes {min_nodes} (one agent per Ray node)"
        )
    group: PlacementGroup = placement_group([dict(bundle)] * size, strategy="STRICT_SPREAD")
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise KeepstepError(
            f"Ray did not place {size} bundles of {dict(bundle)} on distinct nodes within "
            f"{timeout:.0f} s"
        ) from None
    return group


def create_actor(group: PlacementGroup, index: int, bundle: Mapping[str, float]) -> Any:
    """A node actor in bundle `index`; it reserves the bundle's resources while it lives.
    Not restarted by Ray: the launcher decides about replacements."""
    resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    return (
        ray.remote(NodeActor)
        .options(
            num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0),
            resources=resources,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        )
        .remote()
    )


def place_one(bundle: Mapping[str, float]) -> PlacementGroup:
    """A placement group of one more bundle, to grow the job; placed when Ray has room."""
    group: PlacementGroup = placement_group([dict(bundle)], strategy="STRICT_SPREAD")
    return group


def spread_by_resource(bundle: Mapping[str, float]) -> bool:
    """Whether the bundle reserves a custom resource (one a node has once, by convention),
    which keeps separate placement groups on separate nodes."""
    return any(name not in BUILTIN_RESOURCES for name in bundle)


def release(groups: Sequence[PlacementGroup], disconnect: bool) -> None:
    for group in groups:
        remove_placement_group(group)
    if disconnect:
        ray.shutdown()
