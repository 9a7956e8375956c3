"""A sharded job's durable checkpoint as one snapshot: its members' parts joined.

Where it sits: between the agent's durable checkpoints (durable/ writes every member's
snapshot of a step as one part and reads the parts back) and the snapshot format. A
sharded job's snapshot holds the full parameters and only this member's pieces of the
optimizer state (sharded_snapshot.py), so no one member's snapshot is a checkpoint.
``join_parts`` makes one snapshot of all of them, every piece once; it seeds each member
of the resumed job, whatever the job's size. Entering its first epoch each member finds
all it needs held locally (``fetch_and_join`` moves nothing) and its first commit keeps
only its new shard's pieces.

    blobs = [store.export(step) for each member]       # written in parallel, one part each
    seed = join_parts(blobs)                           # SnapshotCorrupt if they do not fit
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from keepstep.elastic import plain_json
from keepstep.elastic.errors import BadMessage, ConfigError, SnapshotCorrupt
from keepstep.elastic.sharded_snapshot import PIECES, is_pieces, take_pieces
from keepstep.elastic.snapshot_buffer import MemoryBuffer
from keepstep.elastic.snapshot_format import decode_payload, read_index
from keepstep.elastic.snapshot_layout import exported_payload
from keepstep.elastic.snapshot_pieces import concat_pieces
from keepstep.elastic.snapshot_store import SnapshotStore

__all__ = ["holds_pieces", "holds_pieces_named", "join_parts"]

_EXTRA = "extra/"
_KEY = f"{_EXTRA}{PIECES}"  # the joined snapshot's tensor of pieces


def holds_pieces_named(names: Iterable[str]) -> bool:
    """Whether a snapshot with tensors ``names`` holds pieces of the optimizer state (one
    tensor, or its segments: sharded_snapshot.take_pieces)."""
    return any(n.startswith(_EXTRA) and is_pieces(n.removeprefix(_EXTRA)) for n in names)


def _pieces_of(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Pop the pieces out of a decoded snapshot's tensors (names with ``extra/``)."""
    extra = {n.removeprefix(_EXTRA): t for n, t in tensors.items() if n.startswith(_EXTRA)}
    raw = take_pieces(extra)
    for name in [n for n in tensors if n.startswith(_EXTRA)]:
        if name.removeprefix(_EXTRA) not in extra:
            del tensors[name]
    return raw


def holds_pieces(blob: bytes | bytearray) -> bool:
    """Whether an exported snapshot (``SnapshotStore.export``) is a sharded member's: it
    holds pieces of the optimizer state, not all of it. Reads the header and index only."""
    step, payload, _ = exported_payload(blob, "snapshot")
    entries, _meta = read_index(step, payload)
    return holds_pieces_named(e.name for e in entries)


def join_parts(blobs: Sequence[bytes]) -> bytes:
    """One exported snapshot from every member's of one step: the first one's parameters,
    optimizer groups, data position and metadata, with the pieces of all of them.

    The parts must be of one step and hold the same tensors with bit-identical model
    parameters (the members of one job at one step do); otherwise ``SnapshotCorrupt``
    names the part that does not fit. Parts without pieces (an unsharded job's) are
    refused: their checkpoint is any one of them."""
    if not blobs:
        raise ConfigError("blobs: a sharded checkpoint needs at least one part")
    decoded: list[tuple[int, dict[str, torch.Tensor], bytes]] = []
    raws: list[bytes] = []
    for i, blob in enumerate(blobs):
        step, payload, _ = exported_payload(blob, f"part {i} of the checkpoint")
        tensors, meta = decode_payload(step, memoryview(bytearray(payload)))
        pieces = _pieces_of(tensors)  # out of `tensors`: members hold different segments
        if pieces is None:
            raise SnapshotCorrupt(f"part {i} of the checkpoint holds no pieces of the state")
        decoded.append((step, tensors, meta))
        raws.append(_bytes(pieces))
    step, first, meta = decoded[0]
    for i, (other_step, tensors, _) in enumerate(decoded[1:], start=1):
        _check_fits(i, other_step, tensors, step, first)
    try:
        raw = concat_pieces(raws)
    except BadMessage as err:
        raise SnapshotCorrupt(f"the checkpoint's pieces of the state: {err}") from None
    joined = {**first, _KEY: torch.frombuffer(bytearray(raw), dtype=torch.uint8)}
    meta = _meta_naming_one_tensor(meta)
    store = SnapshotStore(MemoryBuffer(), background=False)
    try:
        store.commit(step, joined, meta)
        store.wait()
        return store.export(step)
    finally:
        store.close()


def _meta_naming_one_tensor(meta: bytes) -> bytes:
    """The first part's meta, naming the joined snapshot's one tensor of pieces where the
    part's own listed its segments (a train state's ``extra`` list); other meta as is."""
    try:
        data = plain_json.loads(meta)
    except plain_json.PlainJSONError:
        return meta  # not a train state's: train_state.restore says what is wrong with it
    extra = data.get("extra") if isinstance(data, dict) else None
    if not isinstance(extra, list) or not any(isinstance(k, str) and is_pieces(k) for k in extra):
        return meta
    data["extra"] = [k for k in extra if not (isinstance(k, str) and is_pieces(k))] + [PIECES]
    return plain_json.dumps(data)


def _check_fits(
    i: int, step: int, tensors: dict[str, torch.Tensor], at: int, first: dict[str, torch.Tensor]
) -> None:
    if step != at:
        raise SnapshotCorrupt(f"part {i} of the checkpoint is of step {step}, part 0 of {at}")
    if set(tensors) != set(first):
        odd = sorted(set(tensors) ^ set(first))[:4]
        raise SnapshotCorrupt(f"part {i} of the checkpoint holds other tensors than part 0: {odd}")
    for name, value in first.items():
        if not name.startswith("model/"):
            continue
        other = tensors[name]
        if (
            other.dtype != value.dtype
            or other.shape != value.shape
            or _bytes(other) != _bytes(value)
        ):
            raise SnapshotCorrupt(
                f"part {i} of the checkpoint has other parameters than part 0 ({name}): "
                "not the same job at the same step"
            )


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
