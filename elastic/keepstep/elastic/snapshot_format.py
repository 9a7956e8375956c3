"""Reading a snapshot payload back: the tensor index and the tensors as views of it.

Where it sits: between ``SnapshotStore`` (snapshot_store.py), which decides which slot to
read, and the byte layout (snapshot_layout.py). How a step's tensors get into a payload is
snapshot_write.py.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from keepstep.elastic.errors import SnapshotCorrupt
from keepstep.elastic.snapshot_layout import LENGTHS, align


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the payload
    nbytes: int


def read_index(step: int, payload: memoryview) -> tuple[list[TensorEntry], bytes]:
    """The tensor entries (offsets from the payload start) and meta; SnapshotCorrupt if the
    index does not describe this payload."""
    try:
        n_index, n_meta = LENGTHS.unpack_from(payload, 0)
        index = json.loads(bytes(payload[LENGTHS.size : LENGTHS.size + n_index]))
        meta = bytes(payload[LENGTHS.size + n_index : LENGTHS.size + n_index + n_meta])
        data_at = align(LENGTHS.size + n_index + n_meta)
        entries: list[TensorEntry] = []
        for name, dtype_name, shape, offset, nbytes in index:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype) or not all(
                isinstance(n, int) and n >= 0 for n in [*shape, offset, nbytes]
            ):
                raise ValueError(f"entry {name!r}: bad dtype or shape")
            numel = 1
            for n in shape:
                numel *= n
            at = data_at + offset
            if nbytes != numel * dtype.itemsize or at + nbytes > len(payload):
                raise ValueError(f"entry {name!r} does not fit the payload")
            entries.append(TensorEntry(str(name), dtype, tuple(shape), at, nbytes))
    except (ValueError, TypeError, struct.error) as e:
        raise SnapshotCorrupt(f"snapshot of step {step}: unreadable index ({e})") from e
    if len({e.name for e in entries}) != len(entries):
        raise SnapshotCorrupt(f"snapshot of step {step}: duplicate tensor names")
    return entries, meta


def decode_payload(step: int, payload: memoryview) -> tuple[dict[str, torch.Tensor], bytes]:
    """Tensors that are views of ``payload`` (a writable private copy), and meta."""
    entries, meta = read_index(step, payload)
    tensors = {
        e.name: torch.frombuffer(
            payload, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize, offset=e.offset
        ).view(e.shape)
        if e.nbytes
        else torch.empty(e.shape, dtype=e.dtype)
        for e in entries
    }
    return tensors, meta
