"""Reading a slot of a snapshot buffer back: its header, and its payload checked.

Where it sits: beside snapshot_layout.py (the bytes) and snapshot_write.py (the copy in);
``SnapshotStore`` (snapshot_store.py) picks which slot to read and what to do when a read
fails, this module reads one. A payload is read in place, as a private copy, or as one
blob with a slot header in front (a peer's ``import_`` takes it): a new bytes object, or
the bytearray an ``Alloc`` gives, filled from the buffer's file with ``read_into``.

A read is checked twice: the checksum against the header's, and the header (and slot
size) against what they were when the read began. A writer that started on the slot
meanwhile raises ``Changed``, not ``SnapshotCorrupt``: what was read is a mix of two steps,
which says nothing about the memory.
"""

from __future__ import annotations

from collections.abc import Callable

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt
from keepstep.elastic.snapshot_buffer import SnapshotBuffer
from keepstep.elastic.snapshot_layout import (
    FILE_STRUCT,
    HEADER,
    SLOT_MAGIC,
    SLOT_STRUCT,
    SlotHeader,
    SlotState,
    payload_checksum,
    slot_header,
)

Alloc = Callable[[int], bytearray]  # n -> a bytearray of exactly n bytes (export_into)


class Changed(Exception):
    """The slot was rewritten while it was read; not corruption."""


def slot_size(view: memoryview) -> int:
    """The size of each slot, checked against the buffer's length."""
    size = int(FILE_STRUCT.unpack_from(view, 0)[3])
    if size < HEADER or HEADER + 2 * size > len(view):
        raise SnapshotCorrupt(f"snapshot buffer of {len(view)} B: bad slot size {size}")
    return size


def read_header(view: memoryview, slot: int) -> SlotHeader:
    """The header of ``slot`` (the slot size checked first); EMPTY where it holds none of
    ours."""
    slot_size(view)
    h = slot_header(view, slot)
    if h is None or h.state is SlotState.EMPTY:
        return SlotHeader(slot, SlotState.EMPTY, 0, 0, 0, 0)
    return h


def read_headers(view: memoryview) -> list[SlotHeader]:
    return [read_header(view, 0), read_header(view, 1)]


def candidates(headers: list[SlotHeader], step: int | None) -> list[SlotHeader]:
    """The VALID slots (of ``step``, if given), newest first."""
    valid = [h for h in headers if h.state is SlotState.VALID and (step is None or h.step == step)]
    return sorted(valid, key=lambda h: h.generation, reverse=True)


def read_slot(
    buffer: SnapshotBuffer,
    h: SlotHeader,
    *,
    copy: bool,
    as_blob: bool = False,
    alloc: Alloc | None = None,
) -> memoryview:
    """The payload of the slot ``h`` names, checked: in place, or a private copy (what a
    load returns must not change under its caller), or as one blob with a header: a new
    bytes object, or with ``alloc`` the bytearray it gives, read through ``read_into``."""
    view = buffer.view()
    size = slot_size(view)
    if h.nbytes > size - HEADER:
        raise SnapshotCorrupt(
            f"slot {h.slot} (step {h.step}): payload length {h.nbytes} exceeds the slot size {size}"
        )
    at = HEADER + h.slot * size + HEADER
    whole = data = view[at : at + h.nbytes]
    if as_blob or alloc is not None:
        head = SLOT_STRUCT.pack(SLOT_MAGIC, SlotState.VALID, 0, h.step, h.nbytes, h.checksum, 0)
        head = head.ljust(HEADER, b"\0")
        if alloc is None:
            whole = memoryview(b"".join((head, data)))
        else:
            whole = allocated(alloc, HEADER + h.nbytes)
            whole[:HEADER] = head
            buffer.read_into(at, whole[HEADER:])
        data = whole[HEADER:]
    elif copy:
        whole = data = memoryview(bytearray(data))
    crc = payload_checksum(data, h.step)
    view = buffer.view()
    if read_header(view, h.slot) != h or slot_size(view) != size:
        raise Changed
    if crc != h.checksum:
        raise SnapshotCorrupt(
            f"slot {h.slot} (step {h.step}): checksum {crc:#010x}, header says {h.checksum:#010x}"
        )
    return whole


def allocated(alloc: Alloc, n: int) -> memoryview:
    """``alloc(n)``, checked to be a bytearray of exactly n bytes."""
    out = alloc(n)
    if not isinstance(out, bytearray) or len(out) != n:
        got = f"{type(out).__name__} of {len(out)} B" if isinstance(out, bytearray) else repr(out)
        raise ConfigError(f"alloc({n}) gave {got}: it must give a bytearray of exactly {n} B")
    return memoryview(out)
