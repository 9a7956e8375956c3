"""Figures of a sharded job: what entering an epoch measured, and the optimizer-state hash.

Where it sits: beside sharded.py (the job's ZeRO-1/ZeRO-2); the job puts the figures into
its ``Reconfiguration`` records and reports the hash at the end of a run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from keepstep.elastic.sharded import ShardedOptimizer

__all__ = ["ShardFigures", "optimizer_sha256", "shard_figures"]


class ShardFigures(TypedDict):
    """What entering an epoch measured of the sharded state (a `Reconfiguration`'s fields)."""

    stepped_elements: int | None
    reshard_s: float
    reshard_bytes: int


def shard_figures(sharded: ShardedOptimizer | None) -> ShardFigures:
    """The epoch's figures of ``sharded`` (None: full replicas)."""
    if sharded is None:
        return {"stepped_elements": None, "reshard_s": 0.0, "reshard_bytes": 0}
    return {
        "stepped_elements": sharded.stepped_elements(),
        "reshard_s": sharded.enter_s,
        "reshard_bytes": sharded.received_bytes,
    }


def optimizer_sha256(state: Mapping[str, Any]) -> str:
    """sha256 over an optimizer state dict: per parameter index in order, each key's
    values (tensors by dtype, shape and bytes), then the param groups' hyper-parameters.
    The same for the gathered state of a sharded job and the full optimizer's."""
    digest = hashlib.sha256()
    for index in sorted(state["state"]):
        per_param = state["state"][index]
        digest.update(f"param {index}".encode())
        for key in sorted(per_param):
            digest.update(key.encode())
            _feed(digest, per_param[key])
    for group in state["param_groups"]:
        for key in sorted(group):
            digest.update(key.encode())
            _feed(digest, group[key])
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(raw.numpy().tobytes())
    else:
        digest.update(repr(value).encode())
