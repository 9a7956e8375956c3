"""The on-buffer snapshot format: file and slot headers, slot states, the tensor index and
the checksum; reading a payload back.

Where it sits: between ``SnapshotStore`` (snapshot.py), which decides which slot to write
and when, and the raw memory of a ``SnapshotBuffer`` (snapshot_buffer.py). What a byte offset means
lives here; how a step's tensors get there is snapshot_write.py.

Layout (little endian; every offset below is a multiple of 64)::

    file header   64 B        magic "KSTEPSNP", version, slot size
    slot 0        slot size   64 B slot header + payload
    slot 1        slot size

    slot header   magic, state (WRITING/VALID), step, payload length, checksum, generation
    payload       u64 index length, u64 meta length, index (JSON), meta, zero padding, then
                  each tensor's bytes at an offset aligned to 64 (zero padded)

A write marks its slot WRITING, fills the payload, computes the checksum and only then sets
the state VALID (``finish_slot``), so a crash mid-write leaves the other slot loadable. The
checksum is the 64-bit XXH3 (the xxhash package) of the step, the payload length and the
payload; the generation only orders the two slots. Every step checksums the whole state,
so its speed bounds the snapshot: XXH3 runs at memory speed (~35 GB/s on one core here,
CRC-32 ~4 GB/s; bench/snapshot_cost.py measures both). Version 1 buffers used CRC-32.

"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass

import torch
import xxhash

from keepstep.elastic.errors import SnapshotCorrupt

ALIGN = 64
FILE_STRUCT = struct.Struct("<8sIIQ")  # magic, version, reserved, slot size
# magic, state, reserved, step, payload length, crc, generation
SLOT_STRUCT = struct.Struct("<8sIIqQQQ")
_STATE_AT = 8  # byte offset of the state field inside a slot header
_SIGNED = struct.Struct("<qQ")  # step and payload length, folded into the checksum
LENGTHS = struct.Struct("<QQ")  # index length, meta length at the start of a payload
FILE_MAGIC = b"KSTEPSNP"
SLOT_MAGIC = b"KSSLOT\x00\x01"
VERSION = 2
HEADER = 64  # size of the file header and of each slot header
ZEROS = bytes(ALIGN)


class SlotState(enum.IntEnum):
    """A slot is EMPTY until written; WRITING while a copy is in flight (or was cut off)."""

    EMPTY = 0
    WRITING = 1
    VALID = 2


@dataclass(frozen=True)
class SlotHeader:
    """A slot header as read from the buffer."""

    slot: int
    state: SlotState
    step: int
    nbytes: int
    checksum: int
    generation: int


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the payload
    nbytes: int


def finish_slot(view: memoryview, at: int, crc: int) -> None:
    """Write the checksum, then flip the state to VALID: the last write of a slot."""
    magic, _, _, step, nbytes, _, gen = SLOT_STRUCT.unpack_from(view, at)
    SLOT_STRUCT.pack_into(view, at, magic, SlotState.WRITING, 0, step, nbytes, crc, gen)
    struct.pack_into("<I", view, at + _STATE_AT, SlotState.VALID)


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


def payload_checksum(payload: memoryview, step: int) -> int:
    digest = xxhash.xxh3_64(_SIGNED.pack(step, len(payload)))
    digest.update(payload)
    return int(digest.intdigest())


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
