"""Per-step snapshots: double-buffered, checksummed, in memory another process can own.

Where it sits: step 5 of the happy path (ARCHITECTURE.md). After the optimizer step the Job
calls ``SnapshotStore.commit``; the copy runs on a background thread while the next step's
forward/backward runs, and the Job calls ``wait`` before its next ``optimizer.step``. The
buffer is normally a ``FileBuffer`` under /dev/shm that the node agent creates, so a crashed
worker loses nothing: its replacement (or the agent) opens the same file and ``load``s. A
joining node receives a peer's slot through ``export`` / ``import_``.

This module holds the store: which slot to write, growing the slots, verifying and loading;
reading one slot back is snapshot_read.py.
The memory itself is a ``SnapshotBuffer`` (snapshot_buffer.py); the bytes in it, their
headers and checksum are snapshot_layout.py, reading a payload back snapshot_format.py; the
per-step plan and copy job are snapshot_write.py. The names callers need are re-exported
here, so they import from this module only.

A buffer has one writer (the worker) and any number of readers; a store is used from one
thread (plus its own copy thread). Two slots keep a step only until two more commit: a
reader that must not miss one (the node agent writing a durable checkpoint from it) has the
writer ``hold`` it, and ``release``s it once read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import torch

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_buffer import SHM_DIR, FileBuffer, MemoryBuffer, SnapshotBuffer
from keepstep.elastic.snapshot_device import DeviceCopier
from keepstep.elastic.snapshot_format import decode_payload, read_index
from keepstep.elastic.snapshot_layout import (
    ALIGN,
    FILE_MAGIC,
    FILE_STRUCT,
    HEADER,
    SLOT_MAGIC,
    SLOT_STRUCT,
    VERSION,
    SlotHeader,
    SlotState,
    check_step,
    check_timeout,
    empty_slots,
    exported_payload,
    finish_slot,
    mark_released,
    released_step,
)
from keepstep.elastic.snapshot_read import (
    Alloc,
    Changed,
    allocated,
    candidates,
    read_header,
    read_headers,
    read_slot,
    slot_size,
)
from keepstep.elastic.snapshot_seed import SEED_SLOT, Seed
from keepstep.elastic.snapshot_write import (
    CopyJob,
    CopySeconds,
    PayloadPlanner,
    SlotViews,
    check_tensors,
    grow_slots,
)

__all__ = [
    "ALIGN",
    "FILE_MAGIC",
    "HEADER",
    "SHM_DIR",
    "SLOT_MAGIC",
    "VERSION",
    "Alloc",
    "FileBuffer",
    "MemoryBuffer",
    "SlotState",
    "Snapshot",
    "SnapshotBuffer",
    "SnapshotInfo",
    "SnapshotStore",
]

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.002  # how often a commit waiting for a held step's reader looks again


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    slot: int
    nbytes: int
    checksum: int

    def __post_init__(self) -> None:
        check_step(self.step)
        if self.slot not in (0, 1, SEED_SLOT):
            raise ConfigError(f"slot={self.slot!r}: must be 0 or 1 (or {SEED_SLOT}: a seed)")
        if self.nbytes < 0 or not 0 <= self.checksum < 2**64:
            raise ConfigError(f"nbytes={self.nbytes}, checksum={self.checksum}: out of range")


@dataclass(frozen=True)
class Snapshot:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: bytes

    def __post_init__(self) -> None:
        check_step(self.step)
        check_tensors(self.tensors)
        if not isinstance(self.meta, bytes):
            raise ConfigError(f"meta: must be bytes, got {type(self.meta).__name__}")


class SnapshotStore:
    """Two slots in one buffer; ``commit`` writes the one not holding the newest snapshot."""

    def __init__(
        self,
        buffer: SnapshotBuffer,
        *,
        background: bool = True,
        copier: DeviceCopier | None = None,
    ) -> None:
        """``copier`` copies device tensors (snapshot_device.py); the default page-locks the
        buffer's mapping at the first commit of CUDA tensors."""
        self._buffer = buffer
        self._copier = copier if copier is not None else DeviceCopier()
        self._pool = ThreadPoolExecutor(1, "keepstep-snapshot") if background else None
        self._inflight: Future[None] | None = None
        self._job: CopyJob | None = None
        # Where the last durable commit's copy spent its time (snapshot_write.CopySeconds).
        self.last_copy: CopySeconds | None = None
        self._inflight_slot = 0
        self._known_good: dict[int, int] = {}  # slot -> generation verified or written here
        # Kept between commits: the last layout's index and entries, and per slot the
        # destination tensors over the buffer (see SlotViews for when they are dropped).
        self._planner = PayloadPlanner()
        self._views = (SlotViews(), SlotViews())
        self._seed: Seed | None = None  # a checkpoint to start from, and the commits since
        self._since_seed = 0
        self._hold: tuple[int, float] | None = None  # the step kept for a reader, how long
        # How long the last commit (or import) waited for a reader to release a held step.
        self.held_s = 0.0
        self._format()

    # -- writing ---------------------------------------------------------------------------

    def commit(
        self, step: int, tensors: Mapping[str, torch.Tensor], meta: bytes, timeout: float = 60.0
    ) -> None:
        """Start copying a snapshot into the older slot and return; ``wait`` makes it durable.

        The caller must not modify the tensors until ``wait`` returns.
        """
        check_step(step)
        if not isinstance(meta, bytes):
            raise ConfigError(f"meta: must be bytes, got {type(meta).__name__}")
        plan = self._planner.plan(tensors, meta)  # validates the tensors of a new layout
        self.wait(timeout)
        slot, at = self._prepare(step, plan.nbytes)
        job = CopyJob(
            self._buffer, at, step, plan, list(tensors.values()), self._views[slot], self._copier
        )
        self._known_good.pop(slot, None)
        self._inflight_slot, self._job = slot, job
        if self._pool is None:
            job.run()
            self._durable(slot)
        else:
            self._inflight = self._pool.submit(job.run)

    def wait(self, timeout: float = 60.0) -> None:
        """Block until the in-flight copy is in the buffer; re-raises an error of the copy once."""
        check_timeout(timeout)
        future = self._inflight
        if future is None:
            return
        try:
            future.result(timeout)
        except TimeoutError:
            if future.done():
                self._inflight = None
                raise  # the copy itself timed out, not the wait
            raise TimeoutError(f"snapshot copy still running after {timeout} s") from None
        except BaseException:
            self._inflight = None
            raise
        self._inflight = None
        self._durable(self._inflight_slot)

    def hold(self, step: int, timeout: float) -> None:
        """Keep ``step``, the last step committed, in its slot until a reader of the buffer
        ``release``s it (in any process: the node agent reading it for a durable
        checkpoint), rather than let the second commit after it overwrite it. That commit
        waits for the release at most ``timeout`` s, then overwrites the step and logs that
        its reader missed it. One step is held at a time."""
        check_step(step)
        check_timeout(timeout)
        self._hold = (step, timeout)

    def release(self, step: int) -> None:
        """As a reader: done with ``step`` (and every step before it); the writer's commits
        may overwrite it."""
        mark_released(self._buffer.view(), step)

    def seed(
        self, blob: bytes | bytearray, step: int | None = None, timeout: float = 60.0
    ) -> SnapshotInfo:
        """Take ``blob`` (an exported snapshot of ``step`` if given, verified here) as this
        member's state, held in memory (snapshot_seed.py), not in a slot: the whole
        checkpoint a job resumes or falls back from. The slots are emptied: their steps
        are of a timeline the job gave up, which neither this process nor a worker
        restarted over the same buffer may resume from. ``infos``, ``load`` and
        ``export`` serve it (after the slots) until two commits after it are durable."""
        seed = Seed.of(blob, "checkpoint")
        if step is not None and seed.step != step:
            raise SnapshotCorrupt(f"checkpoint: holds step {seed.step}, not {step}")
        self.wait(timeout)
        for views in self._views:
            views.clear()
        empty_slots(self._buffer.view())
        self._known_good.clear()
        self._seed, self._since_seed = seed, 0
        return SnapshotInfo(seed.step, SEED_SLOT, seed.nbytes, seed.checksum)

    def import_(self, blob: bytes | bytearray | memoryview, timeout: float = 60.0) -> SnapshotInfo:
        """Verify a slot received from ``export`` on a peer and write it into the older slot."""
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ConfigError(f"blob: must be bytes, got {type(blob).__name__}")
        step, payload, crc = exported_payload(blob, "received snapshot")
        nbytes = len(payload)
        read_index(step, payload)  # refuse a payload we could not load later
        self.wait(timeout)
        slot, at = self._prepare(step, nbytes)
        self._known_good.pop(slot, None)
        self._views[slot].clear()  # written here, not by a copy: its padding is not ours
        view = self._buffer.view()
        view[at + HEADER : at + HEADER + nbytes] = payload
        finish_slot(view, at, crc)
        self._known_good[slot] = self._header(slot).generation
        return SnapshotInfo(step, slot, nbytes, crc)

    # -- reading ---------------------------------------------------------------------------

    def infos(self) -> list[SnapshotInfo]:
        """Slots whose header and checksum are good, newest first."""
        out = []
        for h in self._candidates(None):
            try:
                read_slot(self._buffer, h, copy=False)
            except (Changed, SnapshotCorrupt):
                continue
            out.append(SnapshotInfo(h.step, h.slot, h.nbytes, h.checksum))
        if (seed := self._seed) is not None:  # older than every slot: they were emptied
            out.append(SnapshotInfo(seed.step, SEED_SLOT, seed.nbytes, seed.checksum))
        return out

    def slot_steps(self) -> list[int]:
        """The steps the slots were last given, from their headers alone: unverified, and
        one may still be being written (cheap where ``infos`` reads every byte)."""
        return [h.step for h in self._headers() if h.state is not SlotState.EMPTY]

    def load(self, step: int | None = None) -> Snapshot:
        """The newest valid snapshot, or the newest one of ``step``; corrupt slots are skipped."""
        payload, h = self._verified(step)
        tensors, meta = decode_payload(h.step, payload)
        return Snapshot(h.step, tensors, meta)

    def export(self, step: int) -> bytes:
        """The verified raw slot (header + payload) of ``step``, for ``import_`` on a peer."""
        check_step(step)
        blob = self._verified(step, as_blob=True)[0].obj
        assert isinstance(blob, bytes)  # _read joined it
        return blob

    def export_into(self, step: int, alloc: Alloc) -> bytearray:
        """``export`` into memory of the caller's: ``alloc(n)`` returns a bytearray of
        exactly n bytes to hold the blob. Memory kept from an earlier export spares the page
        faults of fresh memory, most of a large copy's cost, and the payload is read from
        the buffer's file (``read_into``), not through a mapping new to this process. The
        caller must not use the array for anything else while the result is alive."""
        check_step(step)
        blob = self._verified(step, alloc=alloc)[0].obj
        assert isinstance(blob, bytearray)  # alloc gave it
        return blob

    def close(self) -> None:
        """Finish the in-flight copy and stop the copy thread; the buffer stays open (the
        caller owns it)."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            for views in self._views:  # release their export, so the buffer can close
                views.clear()
            self._copier.release()  # the mapping is no longer page-locked

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _durable(self, slot: int) -> None:
        """A commit into ``slot`` is in the buffer: known good; the second since a seed
        fills both slots, and the seed goes."""
        if self._job is not None:
            self.last_copy, self._job = self._job.seconds, None
        self._known_good[slot] = self._header(slot).generation
        self._since_seed += 1
        if self._since_seed >= 2:
            self._seed = None

    def _format(self) -> None:
        if self._buffer.size < HEADER * 3:
            self._buffer.resize(HEADER * 3)
        view = self._buffer.view()
        magic, version, _, size = FILE_STRUCT.unpack_from(view, 0)
        if magic == b"\0" * 8:
            size = (len(view) - HEADER) // 2 // ALIGN * ALIGN
            for at in (HEADER, HEADER + size):
                view[at : at + HEADER] = bytes(HEADER)  # both slots EMPTY
            FILE_STRUCT.pack_into(view, 0, FILE_MAGIC, VERSION, 0, size)
        elif magic != FILE_MAGIC:
            raise SnapshotCorrupt(f"buffer does not hold snapshots (magic {magic!r})")
        elif version != VERSION:
            raise ConfigError(f"snapshot buffer version {version}: this build reads {VERSION}")
        slot_size(view)

    def _header(self, slot: int) -> SlotHeader:
        return read_header(self._buffer.view(), slot)

    def _headers(self, view: memoryview | None = None) -> list[SlotHeader]:
        return read_headers(self._buffer.view() if view is None else view)

    def _candidates(
        self, step: int | None, headers: list[SlotHeader] | None = None
    ) -> list[SlotHeader]:
        return candidates(self._headers() if headers is None else headers, step)

    def _verified(
        self, step: int | None, *, as_blob: bool = False, alloc: Alloc | None = None
    ) -> tuple[memoryview, SlotHeader]:
        if step is not None:
            check_step(step)
        errors: list[str] = []
        for h in self._candidates(step):
            try:
                return read_slot(self._buffer, h, copy=True, as_blob=as_blob, alloc=alloc), h
            except Changed:
                continue
            except SnapshotCorrupt as e:
                log.warning("skipping corrupt snapshot: %s", e)
                errors.append(str(e))
        if (seed := self._seed) is not None and step in (None, seed.step):  # older than any slot
            if alloc is not None:
                data = allocated(alloc, len(seed.blob))
                data[:] = seed.blob
            else:
                data = memoryview(bytes(seed.blob)) if as_blob else seed.payload()
            return data, SlotHeader(SEED_SLOT, SlotState.VALID, seed.step, seed.nbytes, 0, 0)
        which = "any step" if step is None else f"step {step}"
        if errors:
            raise SnapshotCorrupt(f"no intact snapshot of {which}: " + "; ".join(errors))
        raise SnapshotMissing(f"no snapshot of {which} in the buffer")

    def _target(self, headers: list[SlotHeader]) -> int:
        """The slot to overwrite: not the newest intact one (checked once per generation)."""
        for h in self._candidates(None, headers):
            if self._known_good.get(h.slot) != h.generation:
                try:
                    read_slot(self._buffer, h, copy=False)
                except SnapshotCorrupt:
                    continue
                self._known_good[h.slot] = h.generation
            return 1 - h.slot
        return 0

    def _prepare(self, step: int, nbytes: int) -> tuple[int, int]:
        """Pick the slot, grow the buffer if needed, and mark the slot WRITING; the slot and
        its offset."""
        view = self._buffer.view()
        headers = self._headers(view)
        slot = self._target(headers)
        self._wait_for_release(headers, slot)
        gen = 1 + max(h.generation for h in headers)
        size = slot_size(view)
        if HEADER + nbytes > size:
            slot = self._grow(slot, HEADER + nbytes)
            view = self._buffer.view()
            size = slot_size(view)
        at = HEADER + slot * size
        SLOT_STRUCT.pack_into(view, at, SLOT_MAGIC, SlotState.WRITING, 0, step, nbytes, 0, gen)
        return slot, at

    def _wait_for_release(self, headers: list[SlotHeader], target: int) -> None:
        """Before ``target`` is overwritten (or dropped by growth): if it holds the held
        step, wait until a reader released it, at most the hold's timeout."""
        self.held_s = 0.0
        if self._hold is None:
            return
        step, timeout = self._hold
        held = [h.slot for h in headers if h.state is SlotState.VALID and h.step == step]
        if target not in held:
            if not held:  # gone already (a seed, an import): nothing left to keep
                self._hold = None
            return
        self._hold = None
        started = time.monotonic()
        deadline = started + timeout
        while released_step(self._buffer.view()) < step:
            if time.monotonic() >= deadline:
                log.warning(
                    "step %d was held %g s for its reader, which did not release it: "
                    "overwritten unread",
                    step,
                    timeout,
                )
                break
            time.sleep(HOLD_POLL_S)
        self.held_s = time.monotonic() - started

    def _grow(self, target: int, need: int) -> int:
        """Give both slots room for ``need`` bytes; keeps the newest snapshot, returns the
        slot to write."""
        for views in self._views:  # slot 1 moves, slot 0 may be overwritten
            views.clear()
        target, moved = grow_slots(self._buffer, target, need)
        if moved is not None:
            self._known_good[0] = moved
        self._known_good.pop(1, None)
        return target
