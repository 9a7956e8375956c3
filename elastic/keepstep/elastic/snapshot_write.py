"""Writing a snapshot: the payload plan, the slot's destination tensors and the copy job.

Where it sits: between ``SnapshotStore`` (snapshot_store.py), which picks the slot and calls
these on every commit, and the layout (snapshot_layout.py), which says where each byte
goes. Every step writes the same layout again, so the per-step work is kept small: a
``PayloadPlanner`` builds the index and entries once per layout, a ``SlotViews`` keeps each
slot's destination tensors, and a ``CopyJob`` makes one batched copy and one checksum pass
over the payload (the same value as chaining it entry by entry). Device tensors are copied
on a side stream into page-locked slots (snapshot_device.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import NamedTuple

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.snapshot_buffer import SnapshotBuffer
from keepstep.elastic.snapshot_device import DeviceCopier, Ready
from keepstep.elastic.snapshot_format import TensorEntry
from keepstep.elastic.snapshot_layout import (
    FILE_MAGIC,
    FILE_STRUCT,
    HEADER,
    LENGTHS,
    VERSION,
    ZEROS,
    SlotState,
    align,
    copy_slot1_to_slot0,
    finish_slot,
    payload_checksum,
    slot_header,
)

log = logging.getLogger(__name__)

_GROW_PAGE = 4096


class PayloadPlan:
    """Where one payload's bytes go: the head (lengths, index, meta, padding to
    ``head_len``), the tensor entries (offsets from the payload start) and the length.

    The head is not joined into one bytes object: the copy thread writes its parts. ``entries``
    is the same tuple object for every plan of one layout and head length, so a ``SlotViews``
    can tell by identity that its destination tensors still fit. ``filled`` lists the entries
    with bytes (None when all have some): only those are copied.
    """

    __slots__ = ("entries", "filled", "head_len", "index", "meta", "nbytes")

    def __init__(
        self,
        index: bytes,
        meta: bytes,
        entries: tuple[TensorEntry, ...],
        nbytes: int,
        filled: tuple[int, ...] | None,
    ) -> None:
        self.index, self.meta, self.entries, self.filled = index, meta, entries, filled
        self.head_len = _head_len(index, meta)
        self.nbytes = nbytes

    def write_head(self, view: memoryview, base: int) -> None:
        """Write the head at ``base`` in parts, without joining them first."""
        at = base + LENGTHS.size
        LENGTHS.pack_into(view, base, len(self.index), len(self.meta))
        view[at : at + len(self.index)] = self.index
        at += len(self.index)
        view[at : at + len(self.meta)] = self.meta
        at += len(self.meta)
        view[at : base + self.head_len] = ZEROS[: base + self.head_len - at]


class PayloadPlanner:
    """Where a store's payload bytes go, for a store that commits the same tensors every
    step (a new planner plans from scratch).

    The index and the entries are built (and the tensors validated) only when the names,
    dtypes, shapes or layouts differ from the last commit's; otherwise only the head is
    made again, since meta changes every step. Used from the store's thread only.
    """

    def __init__(self) -> None:
        self._key: object = None
        self._index = b""
        self._rel: tuple[TensorEntry, ...] = ()  # offsets from the first tensor's byte
        self._data = 0
        self._filled: tuple[int, ...] | None = None
        self._entries: tuple[TensorEntry, ...] = ()
        self._head_len = -1

    def plan(self, tensors: Mapping[str, torch.Tensor], meta: bytes) -> PayloadPlan:
        """ConfigError if a tensor cannot be snapshotted (checked when the layout is new)."""
        key = _layout_key(tensors)
        if key is None or key != self._key:
            check_tensors(tensors)
            self._key = None  # a failure below must not leave a half-made layout cached
            self._rel, self._index, self._data = _layout(list(tensors.items()))
            filled = tuple(i for i, e in enumerate(self._rel) if e.nbytes)
            self._filled = None if len(filled) == len(self._rel) else filled
            self._head_len = -1
            self._key = key
        head_len = _head_len(self._index, meta)
        if head_len != self._head_len:  # meta crossed a multiple of ALIGN: tensors move
            self._entries = _shifted(self._rel, head_len)
            self._head_len = head_len
        return PayloadPlan(self._index, meta, self._entries, head_len + self._data, self._filled)


class SlotViews:
    """Destination tensors over one slot's payload, kept from one commit to the next.

    Built on the copy thread the first time a slot is written with a plan's entries in a
    buffer mapping, and used again while the mapping object, the slot offset and the entries
    are the same: a grown buffer (a new mapping or array) or a new layout builds them anew.
    Building zero-fills the payload; the copy never writes between tensors, so the padding
    stays zero for as long as only this store's copies write the slot. The tensors hold an
    export of the buffer: the store calls ``clear`` before it grows the buffer, writes the
    slot any other way, or closes.
    """

    def __init__(self) -> None:
        self._mapping: object = None
        self._base = -1
        self._entries: tuple[TensorEntry, ...] = ()
        self._dsts: list[torch.Tensor] = []

    def get(self, view: memoryview, base: int, plan: PayloadPlan) -> list[torch.Tensor]:
        """One destination per filled entry, for a payload at ``base`` in ``view``."""
        if view.obj is self._mapping and base == self._base and plan.entries is self._entries:
            return self._dsts
        self.clear()
        flat = torch.frombuffer(view, dtype=torch.uint8, count=plan.nbytes, offset=base)
        flat.zero_()
        dsts = [
            flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)
            for e in plan.entries
            if e.nbytes
        ]
        self._mapping, self._base, self._entries, self._dsts = view.obj, base, plan.entries, dsts
        return dsts

    def clear(self) -> None:
        self._mapping, self._base, self._entries, self._dsts = None, -1, (), []


class CopyJob:
    """One copy of tensors into a slot already marked WRITING; made on the committing
    thread (which records where device tensors are ready), run on the copy thread."""

    def __init__(
        self,
        buffer: SnapshotBuffer,
        at: int,
        step: int,
        plan: PayloadPlan,
        tensors: list[torch.Tensor],
        views: SlotViews,
        copier: DeviceCopier,
    ) -> None:
        self.buffer, self.at, self.step, self.plan = buffer, at, step, plan
        self.tensors, self.views, self.copier = tensors, views, copier
        self.ready: Ready | None = copier.mark(tensors)
        self.seconds: CopySeconds | None = None  # set by run

    def run(self) -> None:
        t0 = time.perf_counter()
        view = self.buffer.view()
        base, plan = self.at + HEADER, self.plan
        dsts = self.views.get(view, base, plan)
        plan.write_head(view, base)
        t1 = time.perf_counter()
        if dsts:
            srcs = self.tensors
            if plan.filled is not None:
                srcs = [srcs[i] for i in plan.filled]
            with torch.no_grad():
                self.copier.copy(view, dsts, srcs, self.ready)
        t2 = time.perf_counter()
        # One pass over the whole payload gives the same value as chaining per entry: the
        # head, the tensors and their padding are contiguous and in order.
        crc = payload_checksum(view[base : base + plan.nbytes], self.step)
        finish_slot(view, self.at, crc)
        self.seconds = CopySeconds(t1 - t0, t2 - t1, time.perf_counter() - t2, plan.nbytes)


class CopySeconds(NamedTuple):
    """Where one commit's copy spent its time, on the copy thread: the slot's views (built,
    and zero-filled, when the slot or the layout is new) and the head; the tensors' copy
    (a device copy: until its bytes are on the host); the checksum."""

    prepare: float
    copy: float
    checksum: float
    nbytes: int


def check_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    """ConfigError unless ``tensors`` maps non-empty names to dense tensors with data."""
    if not isinstance(tensors, Mapping):
        raise ConfigError(f"tensors: must be a mapping of name to tensor, got {type(tensors)}")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"tensor name {name!r}: must be a non-empty str")
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"tensors[{name!r}]: must be a torch.Tensor, got {type(t).__name__}")
        if t.layout is not torch.strided or t.is_quantized or t.is_meta:
            raise ConfigError(
                f"tensors[{name!r}]: only dense tensors with data can be "
                f"snapshotted (layout {t.layout}, device {t.device})"
            )


def _layout_key(tensors: Mapping[str, torch.Tensor]) -> object:
    """What the layout depends on, and everything check_tensors looks at (a quantized tensor
    has a quantized dtype), so one check per key suffices; None if it cannot even be built
    (then check_tensors says why). Its attribute reads are most of what a commit costs the
    caller's thread; the comparison with the last key is cheap."""
    if not isinstance(tensors, Mapping):
        return None
    try:
        return tuple(tensors), [(t.dtype, t.shape, t.layout, t.is_meta) for t in tensors.values()]
    except AttributeError:
        return None


def _layout(
    items: list[tuple[str, torch.Tensor]],
) -> tuple[tuple[TensorEntry, ...], bytes, int]:
    """Entries with offsets from the first tensor byte, the JSON index, the tensor bytes."""
    entries, offset = [], 0
    for name, t in items:
        entries.append(
            TensorEntry(name, t.dtype, tuple(t.shape), offset, t.numel() * t.element_size())
        )
        offset = align(offset + entries[-1].nbytes)
    index = json.dumps(
        [
            [e.name, str(e.dtype).removeprefix("torch."), e.shape, e.offset, e.nbytes]
            for e in entries
        ],
        separators=(",", ":"),
    ).encode()
    return tuple(entries), index, offset


def _head_len(index: bytes, meta: bytes) -> int:
    return align(LENGTHS.size + len(index) + len(meta))


def _shifted(entries: tuple[TensorEntry, ...], by: int) -> tuple[TensorEntry, ...]:
    return tuple(TensorEntry(e.name, e.dtype, e.shape, e.offset + by, e.nbytes) for e in entries)


def grow_slots(buffer: SnapshotBuffer, target: int, need: int) -> tuple[int, int | None]:
    """Give both slots of ``buffer`` room for ``need`` bytes (and an eighth more, for the
    meta to grow), keeping the newest snapshot: slot 1 moves, so when slot 0 is to be
    written, slot 1's snapshot goes to slot 0 first and slot 1 is written instead. Returns
    the slot to write and, when a snapshot moved, its generation. The caller holds no
    views over the buffer."""
    view = buffer.view()
    old = int(FILE_STRUCT.unpack_from(view, 0)[3])
    new = -(-(need + need // 8) // _GROW_PAGE) * _GROW_PAGE
    log.info("snapshot slots of %d B cannot hold %d B: growing them to %d B", old, need, new)
    keep, moved = slot_header(view, 1), None
    if target == 0 and keep is not None and keep.state is SlotState.VALID:
        copy_slot1_to_slot0(view, old, keep.nbytes)
        target, moved = 1, keep.generation
    del view
    if buffer.size < HEADER + 2 * new:
        buffer.resize(HEADER + 2 * new)
    view = buffer.view()
    view[HEADER + new : 2 * HEADER + new] = bytes(HEADER)  # slot 1 starts EMPTY
    FILE_STRUCT.pack_into(view, 0, FILE_MAGIC, VERSION, 0, new)
    return target, moved
