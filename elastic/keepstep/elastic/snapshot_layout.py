"""The on-buffer snapshot layout: file and slot headers, slot states and the checksum.

Where it sits: the byte layout shared by ``SnapshotStore`` (snapshot_store.py), the copy
(snapshot_write.py) and the payload reader (snapshot_format.py); torch-free, so that tools
that only look at a snapshot file (the chaos harness corrupting a slot, say) read the same
definitions without importing torch.

Layout (little endian; every offset below is a multiple of 64)::

    file header   64 B        magic "KSTEPSNP", version, slot size, released step
    slot 0        slot size   64 B slot header + payload
    slot 1        slot size

    slot header   magic, state (WRITING/VALID), step, payload length, checksum, generation
    payload       u64 index length, u64 meta length, index (JSON), meta, zero padding, then
                  each tensor's bytes at an offset aligned to 64 (zero padded)

A write marks its slot WRITING, fills the payload, computes the checksum and only then sets
the state VALID (``finish_slot``), so a crash mid-write leaves the other slot loadable. The
checksum is the 64-bit XXH3 (the xxhash package) of the step, the payload length and the
payload; the generation only orders the two slots. Every step checksums the whole state,
so its speed bounds the snapshot: XXH3 runs at memory speed (~35 GB/s on one core,
CRC-32 ~4 GB/s; bench/snapshot_cost.py measures both). Version 1 buffers used CRC-32.

The released step is the one field a reader writes: the newest step a reader (the node
agent, exporting a durable checkpoint) is done with, so that a writer holding that step's
slot for it may overwrite it (``SnapshotStore.hold``). It is 0 until a reader releases a
step; files written before it existed hold 0 there too (the header's unused bytes).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt

ALIGN = 64
FILE_STRUCT = struct.Struct("<8sIIQ")  # magic, version, reserved, slot size
RELEASED = struct.Struct("<q")  # after FILE_STRUCT: the newest step a reader released
_RELEASED_AT = FILE_STRUCT.size
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


def finish_slot(view: memoryview, at: int, crc: int) -> None:
    """Write the checksum, then flip the state to VALID: the last write of a slot."""
    magic, _, _, step, nbytes, _, gen = SLOT_STRUCT.unpack_from(view, at)
    SLOT_STRUCT.pack_into(view, at, magic, SlotState.WRITING, 0, step, nbytes, crc, gen)
    struct.pack_into("<I", view, at + _STATE_AT, SlotState.VALID)


def payload_checksum(payload: memoryview, step: int) -> int:
    digest = xxhash.xxh3_64(_SIGNED.pack(step, len(payload)))
    digest.update(payload)
    return int(digest.intdigest())


def exported_payload(
    blob: bytes | bytearray | memoryview, what: str
) -> tuple[int, memoryview, int]:
    """The step, verified payload and checksum of one exported slot (a peer's transfer, a durable
    checkpoint's blob); SnapshotCorrupt, its message starting with `what`, if the header
    or the checksum does not check out."""
    if len(blob) < HEADER:
        raise SnapshotCorrupt(f"{what}: {len(blob)} B, shorter than a header")
    magic, state, _, step, nbytes, checksum, _ = SLOT_STRUCT.unpack_from(blob, 0)
    payload = memoryview(blob)[HEADER:]
    if magic != SLOT_MAGIC or state != SlotState.VALID or nbytes != len(payload):
        raise SnapshotCorrupt(
            f"{what}: not a snapshot slot (magic {magic!r}, state {state}, "
            f"payload {nbytes} B of {len(payload)} B)"
        )
    if payload_checksum(payload, step) != checksum:
        raise SnapshotCorrupt(f"{what}: payload checksum mismatch")
    return int(step), payload, int(checksum)


def slot_header(view: memoryview, slot: int) -> SlotHeader | None:
    """The header of `slot` in a whole snapshot file, or None if it is not one of ours."""
    slot_size = int(FILE_STRUCT.unpack_from(view, 0)[3])
    magic, state, _, step, nbytes, crc, gen = SLOT_STRUCT.unpack_from(
        view, HEADER + slot * slot_size
    )
    if magic != SLOT_MAGIC or state not in iter(SlotState):
        return None
    return SlotHeader(slot, SlotState(state), step, nbytes, crc, gen)


def slot_intact(view: memoryview, slot: int) -> bool:
    """Whether `slot` of a whole snapshot file is VALID with a matching checksum: the check
    the store makes before it trusts a slot."""
    h = slot_header(view, slot)
    if h is None or h.state is not SlotState.VALID:
        return False
    at = HEADER + slot * int(FILE_STRUCT.unpack_from(view, 0)[3]) + HEADER
    if at + h.nbytes > len(view):
        return False
    return payload_checksum(view[at : at + h.nbytes], h.step) == h.checksum


def released_step(view: memoryview) -> int:
    """The newest step a reader of this snapshot file released (0: none yet)."""
    return int(RELEASED.unpack_from(view, _RELEASED_AT)[0])


def mark_released(view: memoryview, step: int) -> None:
    """Release ``step`` and every step before it to the file's writer; a release never
    goes back (an older one arriving late leaves the newer in place)."""
    check_step(step)
    if step > released_step(view):
        RELEASED.pack_into(view, _RELEASED_AT, step)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def empty_slots(view: memoryview) -> None:
    """Mark both slots of a whole snapshot file EMPTY: what they held is not to be loaded."""
    slot_size = int(FILE_STRUCT.unpack_from(view, 0)[3])
    for at in (HEADER, HEADER + slot_size):
        view[at : at + HEADER] = bytes(HEADER)


def copy_slot1_to_slot0(view: memoryview, slot_size: int, nbytes: int) -> None:
    """Copy slot 1's snapshot (``nbytes`` of payload) into slot 0, which stays where it is
    when slots grow: slot 0 marked WRITING first, its header last, so a crash at any point
    leaves one intact copy."""
    src, dst = HEADER + slot_size, HEADER
    SLOT_STRUCT.pack_into(view, dst, SLOT_MAGIC, SlotState.WRITING, 0, 0, 0, 0, 0)
    view[dst + HEADER : dst + HEADER + nbytes] = view[src + HEADER : src + HEADER + nbytes]
    view[dst : dst + HEADER] = view[src : src + HEADER]


def check_step(step: int) -> None:
    """``ConfigError`` unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step={step!r}: must be an int >= 0")


def check_timeout(timeout: float) -> None:
    """``ConfigError`` unless ``timeout`` is a number of seconds > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"timeout={timeout!r}: must be a number of seconds > 0")
