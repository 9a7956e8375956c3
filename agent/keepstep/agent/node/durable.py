"""Durable checkpoints from the agent's side: write them from the node's snapshot file,
and hand workers one to resume a whole job from.

The training process never waits for object storage: the agent reads the verified slot
the worker already committed to shared memory and hands it to a `CheckpointWriter`.

The snapshot modules import torch, so they are imported where they are first used: the
agent starts its workers before it imports torch itself (`agent.NodeAgent.start`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from keepstep.agent.durable.parts import unbundle
from keepstep.agent.durable.writer import CheckpointError, CheckpointWriter, Part
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, SnapshotMissing

if TYPE_CHECKING:
    from keepstep.elastic.snapshot_store import Alloc, SnapshotStore

log = logging.getLogger(__name__)


def resume_file(run_dir: Path, node: str, blob: bytes) -> tuple[Path, int]:
    """Write a checkpoint for this node's workers to resume from, and return its path and
    step: each worker holds it in memory until its own commits replace it (the store's
    ``seed``; KEEPSTEP_RESUME names the file). A sharded job's checkpoint is its members'
    parts: joined, they hold every piece of the optimizer state, many times what a
    worker's snapshot slots hold, so it does not go into them; the worker keeps its new
    shard's pieces at its first commit. ``SnapshotCorrupt`` unless it is a whole
    snapshot."""
    from keepstep.elastic.sharded_checkpoint import join_parts
    from keepstep.elastic.snapshot_seed import Seed

    parts = unbundle(blob)
    if parts is not None:
        blob = join_parts(parts)
    step = Seed.of(blob, "the checkpoint to resume from").step
    path = run_dir / f"resume-{node}-step-{step}.ckpt"
    write_private(path, blob)
    return path, step


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by this user only (it is the model's state)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


EXPORT_WAIT_S = 30.0  # for a copy still in flight when the agent comes to read its step
_EXPORT_POLL_S = 0.05
# A release never goes back (snapshot_layout.mark_released), read and written under this
# lock, since threads of this agent release steps of one file concurrently.
_RELEASE_LOCK = threading.Lock()


def export_step(
    path: Path, step: int, wait: float = EXPORT_WAIT_S, alloc: Alloc | None = None
) -> bytes | bytearray | None:
    """The verified bytes of `step` from a snapshot file, waiting out a copy in flight (at
    most `wait` s); None once a newer step took its slot (the worker went on before the
    agent got to it). With `alloc`, into the memory it gives (`SnapshotStore.export_into`).
    Either way the step is released to the worker, which holds a step due for a
    checkpoint until it is (`SnapshotStore.hold`)."""
    from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

    deadline = time.monotonic() + wait
    while True:
        buffer = FileBuffer.open(path)
        try:
            store = SnapshotStore(buffer, background=False)
            blob, final = _export(store, step, alloc)
            if final or time.monotonic() >= deadline:
                with _RELEASE_LOCK:
                    store.release(step)
                return blob
        finally:
            buffer.close()
        time.sleep(_EXPORT_POLL_S)


def _export(
    store: SnapshotStore, step: int, alloc: Alloc | None
) -> tuple[bytes | bytearray | None, bool]:
    """`step`'s bytes, or None and whether it is gone for good."""
    try:
        return (store.export(step) if alloc is None else store.export_into(step, alloc)), True
    except (SnapshotMissing, SnapshotCorrupt):
        # Steps commit in order: a newer one took (or is taking) its slot. Headers only:
        # this runs every poll while a copy is in flight, beside the training.
        return None, any(s > step for s in store.slot_steps())


def release_step(path: Path, step: int) -> None:
    """Release `step` to the worker writing `path` without reading it (a step its worker
    held that this node does not checkpoint); nothing if the file is gone."""
    from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

    try:
        buffer = FileBuffer.open(path)
    except FileNotFoundError:
        return
    try:
        with _RELEASE_LOCK:
            SnapshotStore(buffer, background=False).release(step)
    finally:
        buffer.close()


def export_newest(path: Path) -> tuple[int, bytes] | None:
    """The newest verified step in a snapshot file and its bytes, if any."""
    from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

    buffer = FileBuffer.open(path)
    try:
        store = SnapshotStore(buffer, background=False)
        for info in store.infos():  # newest first
            try:
                return info.step, store.export(info.step)
            except (SnapshotMissing, SnapshotCorrupt):
                continue
        return None
    finally:
        buffer.close()


class ExportBuffers:
    """The memory this agent exports due steps into, kept between checkpoints: per member,
    the buffer of its last export once the writer is done with it.

    The worker holds a due step until the agent has read it (`SnapshotStore.hold`), so the
    export's speed is the worker's stall. Into fresh memory it is bound by page faults:
    ~0.5 s a GiB, against ~0.16 s into memory touched before (bench/checkpoint_hold.py).
    The price: between checkpoints the agent keeps one snapshot's size per member, as much
    as each checkpoint needs anyway."""

    def __init__(self) -> None:
        self._idle: dict[str, bytearray] = {}
        self._lock = threading.Lock()
        self.reused = 0  # exports that went into a kept buffer

    def lease(self, member: str) -> ExportLease:
        return ExportLease(self, member)

    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._idle.values())

    def take(self, member: str, nbytes: int) -> bytearray | None:
        """The member's idle buffer if it is exactly `nbytes` long (it is taken out)."""
        with self._lock:
            idle = self._idle.get(member)
            if idle is None or len(idle) != nbytes:
                return None
            self.reused += 1
            return self._idle.pop(member)

    def give(self, member: str, buffer: bytearray) -> None:
        """Keep `buffer` as the member's idle one (an older one goes)."""
        with self._lock:
            self._idle[member] = buffer


class ExportLease:
    """One export's memory: `alloc` for `export_step`, `release` once nothing reads it."""

    def __init__(self, pool: ExportBuffers, member: str) -> None:
        self._pool, self._member = pool, member
        self._buffer: bytearray | None = None

    def alloc(self, nbytes: int) -> bytearray:
        if self._buffer is None or len(self._buffer) != nbytes:
            self._buffer = self._pool.take(self._member, nbytes) or bytearray(nbytes)
        return self._buffer

    def release(self) -> None:
        """Give the memory back (once; later calls do nothing)."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._pool.give(self._member, buffer)


class DurableCheckpoints:
    """This node's side of the job's durable checkpoints. An unsharded job's checkpoint is
    one member's snapshot: the epoch's first member's node writes it. A sharded member's
    snapshot holds only its pieces of the optimizer state, so every member writes its own
    as a part, in parallel, and the first member's writer publishes the step once all
    parts are in (durable/parts.py). Which job this is, the snapshot says: it is read from
    the first one exported and then known for the job's life."""

    def __init__(
        self, make_writer: Callable[[], CheckpointWriter], events: EventLog, steps: int
    ) -> None:
        self.events, self.steps = events, steps
        self._make_writer = make_writer
        self.writer = make_writer()  # the whole snapshot's (and, sharded, a part's)
        self._part_writers: dict[str, CheckpointWriter] = {}
        self.buffers = ExportBuffers()
        self._sharded: bool | None = None  # unknown until a snapshot was exported
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def after_commit(self, snapshot: Path, done: int, member: str, epoch: EpochRecord) -> None:
        """Checkpoint step `done` if it is due (every K steps, and the last step): the
        member's snapshot as the whole checkpoint (the epoch's first member) or as its part
        (any member of a sharded job). `epoch` is the one the step committed in."""
        first = epoch.members[0] == member
        if not first and self._sharded is False:
            return
        # A member's writer knows what it wrote already; a part writer is made only once
        # a snapshot showed the job sharded, and until then the cadence decides.
        writer = self.writer if first else self._part_writers.get(member)
        due = writer.due(done) if writer is not None else done % self.writer.every_steps == 0
        if due or done == self.steps:
            args = (snapshot, done, member, epoch, first)
            thread = threading.Thread(target=self._write, args=args, daemon=True)
            self._threads.append(thread)
            thread.start()
        elif done % self.writer.every_steps == 0:
            release_step(snapshot, done)  # held by its worker, written already (a rollback)

    def _write(
        self, snapshot: Path, done: int, member: str, epoch: EpochRecord, first: bool
    ) -> None:
        lease = self.buffers.lease(member)
        submitted: tuple[CheckpointWriter, int, Part | None] | None = None
        try:
            submitted = self._submit(snapshot, done, member, epoch, first, lease)
        finally:
            if submitted is None:  # the writer did not take the blob: nothing reads it
                lease.release()
        if submitted is not None:
            writer, step, part = submitted
            fields = {} if part is None else {"part": part.index, "parts": part.count}
            self.events.write(
                EventKind.CHECKPOINT_SUBMITTED, step=step, url=writer.url, member=member, **fields
            )

    def _submit(
        self,
        snapshot: Path,
        done: int,
        member: str,
        epoch: EpochRecord,
        first: bool,
        lease: ExportLease,
    ) -> tuple[CheckpointWriter, int, Part | None] | None:
        """Export step `done` (or the step standing in for it) into `lease`'s memory and
        submit it: the writer, step and part it went to, or None if nothing was submitted.
        Once submitted, the writer releases the lease after its write."""
        from keepstep.elastic.sharded_checkpoint import holds_pieces

        blob: bytes | bytearray | None = export_step(snapshot, done, alloc=lease.alloc)
        if blob is None and first and self._sharded is not True:
            # One member's snapshot is the whole checkpoint: the newest step stands in for
            # the one gone, so a due checkpoint is late rather than missing. (A sharded
            # step's parts must all be of one step; the next due step is written instead.)
            newest = export_newest(snapshot)
            if newest is not None and newest[0] > done and not holds_pieces(newest[1]):
                log.warning(
                    "step %d left the snapshot before it was read; checkpointing step %d "
                    "in its place",
                    done,
                    newest[0],
                )
                done, blob = newest
        if blob is None:
            log.warning("no verified snapshot of step %d to checkpoint", done)
            return None
        if self._sharded is None:
            self._sharded = holds_pieces(blob)
        if not self._sharded and not first:
            return None
        part = None
        if self._sharded:
            part = Part(epoch.epoch, epoch.members.index(member), len(epoch.members), publish=first)
        writer = self.writer if first else self._part_writer(member)
        try:
            writer.submit(done, blob, part, on_done=lease.release)
        except ConfigError as e:  # written already: a step committed again after a rollback
            log.info("checkpoint of step %d not submitted: %s", done, e)
            return None
        return writer, done, part

    def _part_writer(self, member: str) -> CheckpointWriter:
        with self._lock:
            if member not in self._part_writers:
                self._part_writers[member] = self._make_writer()
            return self._part_writers[member]

    def close(self, timeout: float) -> None:
        """Write what is pending; raise `CheckpointError` if this node's newest checkpoint
        write failed. A failed write older than a step this node wrote since (a member's
        part of a step, written by its writer before the member became its epoch's first
        and went on with the other writer) is only logged."""
        for thread in self._threads:
            thread.join(timeout=5.0)
        with self._lock:
            writers = [self.writer, *self._part_writers.values()]
        errors: list[CheckpointError] = []
        for writer in writers:
            try:
                writer.close(timeout=timeout)
            except CheckpointError as failed:
                errors.append(failed)
        newest = max((info.step for w in writers for info in w.written()), default=-1)
        for e in errors:
            if e.step is None or e.step >= newest:
                raise e
            log.warning("%s (step %d was written since)", e, newest)
