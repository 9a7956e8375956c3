"""One durable checkpoint's blob, verified and decoded into plain state dicts.

Where it sits: after catalog.read_blob (which checked the blob against its record's sha256)
and before export.py writes a file or cli.py lists the hashes. A blob is one snapshot slot
(keepstep.elastic.snapshot_layout: header, then a payload of tensors and meta) holding what
train_state.capture took after a committed step. Decoding it here does not need the model's
class: the model's state dict is the ``model/`` tensors in their saved order, the optimizer's
is rebuilt in the shape ``torch.optim.Optimizer.state_dict()`` returns (its param groups and
per-parameter state, which capture split into tensors and plain values), and each tracked
object's state dict is decoded by ``TrackedState`` itself. The reducer's ``extra/`` state
is keepstep's own and is left out.

Every tensor is copied out of the blob into memory of its own, so that what is written holds
each tensor once and nothing of the rest of the payload. The meta is read as the snapshot's
tagged JSON, which builds plain values only (a checkpoint may come from anywhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from keepstep.agent.durable.parts import unbundle
from keepstep.elastic import train_state
from keepstep.elastic.errors import SnapshotCorrupt
from keepstep.elastic.sharded_checkpoint import holds_pieces_named, join_parts
from keepstep.elastic.snapshot_format import TensorEntry, read_index
from keepstep.elastic.snapshot_layout import exported_payload
from keepstep.elastic.tracked import TrackedState
from keepstep.elastic.train_state import load_meta


@dataclass(frozen=True)
class Contents:
    step: int
    model: dict[str, torch.Tensor]  # the model's state_dict()
    optimizer: dict[str, Any]  # the optimizer's state_dict(): {"state": ..., "param_groups": ...}
    state: dict[str, Any]  # tracked name -> that object's state_dict(), in registration order
    params_sha256: str  # what the job reported for this state (``params_sha256`` below)
    state_sha256: dict[str, str]  # tracked name -> its hash (``Job.state_sha256(name)``)
    sharded: bool = False  # a sharded job's: the per-parameter optimizer state is in pieces


def decode(step: int, blob: bytes) -> Contents:
    """The state in a blob of ``step``; SnapshotCorrupt naming what does not check out. A
    sharded job's blob (its members' parts) is joined first; its optimizer state is in
    pieces, which ``Contents.sharded`` says and ``optimizer`` leaves out."""
    parts = unbundle(blob)
    if parts is not None:
        blob = join_parts(parts)
    saved_step, payload, _ = exported_payload(blob, f"checkpoint of step {step}")
    if saved_step != step:
        raise SnapshotCorrupt(f"checkpoint of step {step} holds the snapshot of step {saved_step}")
    entries, raw_meta = read_index(step, payload)
    tensors = {e.name: _copy(payload, e) for e in entries}
    meta = load_meta(raw_meta)
    try:
        model = {k: tensors[f"model/{k}"] for k in meta["model"]}
        optimizer = _optimizer(meta, tensors)
        tracked = _tracked(meta.get("tracked", []), tensors)
    except (KeyError, TypeError, ValueError) as e:  # ValueError: ConfigError of a bad name
        raise SnapshotCorrupt(
            f"checkpoint of step {step}: meta and tensors disagree ({e!r})"
        ) from None
    held = zip(tracked.names, tracked.objects(), strict=True)
    states = {name: obj.state_dict() for name, obj in held}
    return Contents(
        step,
        model,
        optimizer,
        states,
        params_sha256(model, tracked),
        {name: tracked.sha256(name) for name in tracked.names},
        sharded=holds_pieces_named(tensors),
    )


def params_sha256(model: Mapping[str, torch.Tensor], tracked: TrackedState) -> str:
    """``Job.params_sha256`` of a job whose model has this state dict and whose tracked
    objects are ``tracked``."""
    return train_state.params_sha256(model, tracked.sha256() if tracked.names else None)


class _Held:
    """A tracked object stood in for by its state dict (the script's own class is not here)."""

    def __init__(self) -> None:
        self.state: Any = {}

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any, /) -> None:
        self.state = state


def _tracked(entries: object, tensors: Mapping[str, torch.Tensor]) -> TrackedState:
    """The snapshot's tracked objects, in their order, as stand-ins holding their state."""
    tracked = TrackedState()
    if not isinstance(entries, list):
        raise SnapshotCorrupt("snapshot meta: tracked state entries are malformed")
    for entry in entries:
        if not (isinstance(entry, list) and entry and isinstance(entry[0], str)):
            raise SnapshotCorrupt(f"snapshot meta: bad tracked state entry {entry!r:.80}")
        tracked.add(entry[0], _Held())
    tracked.load(tracked.decode(entries, tensors))
    return tracked


def _optimizer(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """torch's optimizer state dict from what train_state.capture split apart."""
    groups = []
    for gi, (plain, keys) in enumerate(zip(meta["groups"], meta["group_tensors"], strict=True)):
        groups.append({**plain, **{k: tensors[f"optim/groups/{gi}/{k}"] for k in keys}})
    state = {
        i: {**{k: tensors[f"optim/{i}/{k}"] for k in meta["state_tensors"][i]}, **plain}
        for i, plain in meta["state"].items()
    }
    return {"state": state, "param_groups": groups}


def _copy(payload: memoryview, e: TensorEntry) -> torch.Tensor:
    if not e.nbytes:
        return torch.empty(e.shape, dtype=e.dtype)
    own = bytearray(payload[e.offset : e.offset + e.nbytes])  # writable, this tensor's only
    return torch.frombuffer(own, dtype=e.dtype).view(e.shape)
