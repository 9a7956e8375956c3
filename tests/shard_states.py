"""Sharded optimizer state for tests: a trained Adam, and its members' snapshots as a
sharded job makes them (the parameters whole, each member's pieces of the state)."""

from __future__ import annotations

from typing import Any

import torch

from keepstep.elastic.shard import make_chunk_layout, place_replicas
from keepstep.elastic.sharded_snapshot import pieces_tensor, snapshot_entries, take_pieces
from keepstep.elastic.snapshot_buffer import MemoryBuffer
from keepstep.elastic.snapshot_pieces import pack_segments, unpack_pieces
from keepstep.elastic.snapshot_shard import cut_state, join_states, snapshot_ranges
from keepstep.elastic.snapshot_store import SnapshotStore
from keepstep.elastic.zero import ALIGN, ELEMENTWISE

KEYS = ELEMENTWISE[torch.optim.Adam]
PIECES = "extra/shard_pieces"


def trained_adam() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters of odd sizes (one empty, one a scalar) and an amsgrad Adam 3 steps in."""
    g = torch.Generator().manual_seed(7)
    shapes: list[tuple[int, ...]] = [(37, 5), (300,), (0,), (700, 3), ()]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def export(step: int, tensors: dict[str, torch.Tensor], meta: bytes = b"{}") -> bytes:
    """An exported snapshot slot of ``tensors``, as ``SnapshotStore.export`` gives it."""
    store = SnapshotStore(MemoryBuffer(), background=False)
    try:
        store.commit(step, tensors, meta)
        store.wait()
        return store.export(step)
    finally:
        store.close()


def member_snapshots(
    members: list[str], step: int = 9, segments: bool = False
) -> tuple[list[bytes], dict[str, Any], list[torch.nn.Parameter]]:
    """Each member's exported snapshot of ``step``, the full optimizer state, the params.
    The pieces in one tensor (as snapshots were written first), or with ``segments`` in
    a job's segments (sharded_snapshot.snapshot_entries)."""
    params, opt = trained_adam()
    sizes = [p.numel() for p in params]
    full = opt.state_dict()
    holds = snapshot_ranges(place_replicas(make_chunk_layout(sizes, members, align=ALIGN), 1))
    blobs = []
    for m in members:
        tensors = {f"model/{i}": p.detach() for i, p in enumerate(params)}
        if segments:
            cut = cut_state(full, sizes, KEYS, holds[m])
            entries = snapshot_entries(pack_segments(cut))
            tensors.update({f"extra/{name}": t for name, t in entries.items()})
        else:
            tensors[PIECES] = pieces_tensor(full, sizes, KEYS, holds[m])
        blobs.append(export(step, tensors, f'{{"member": "{m}"}}'.encode()))
    return blobs, full, params


def state_of(blob: bytes, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """What an exported snapshot holds: step, meta, tensors, and the optimizer state its
    pieces join into (``StateShapeError`` if they do not cover it)."""
    store = SnapshotStore(MemoryBuffer(), background=False)
    try:
        store.import_(blob)
        snap = store.load()
    finally:
        store.close()
    sizes = [p.numel() for p in params]
    extra = {n.removeprefix("extra/"): t for n, t in snap.tensors.items() if n.startswith("extra/")}
    pieces = take_pieces(extra)  # one tensor, or a job's segments
    assert pieces is not None, "the snapshot holds no pieces"
    raw = pieces.numpy().tobytes()
    shapes = [p.shape for p in params]
    state = join_states([unpack_pieces(raw, sizes, KEYS)], sizes, KEYS, shapes)
    return {"step": snap.step, "meta": snap.meta, "state": state, "tensors": snap.tensors}
