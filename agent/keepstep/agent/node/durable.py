"""Durable checkpoints from the agent's side: write them from the node's snapshot file,
and seed workers' snapshot files from one to resume a whole job.

The training process never waits for object storage: the agent reads the verified slot
the worker already committed to shared memory and hands it to a `CheckpointWriter`.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from keepstep.agent.durable.writer import CheckpointWriter
from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

log = logging.getLogger(__name__)


def seed_snapshot(path: Path, blob: bytes, events: EventLog, member: str) -> None:
    """Put a checkpoint into a worker's (new) snapshot file: the worker resumes from it."""
    path.unlink(missing_ok=True)
    buffer = FileBuffer.create(path)
    try:
        info = SnapshotStore(buffer, background=False).import_(blob)
    finally:
        buffer.close()
    events.write(EventKind.RESUMED, member=member, step=info.step)


def export_step(path: Path, step: int, attempts: int = 40) -> bytes | None:
    """The verified bytes of `step` from a snapshot file, waiting out a copy in flight."""
    for _ in range(attempts):
        buffer = FileBuffer.open(path)
        try:
            return SnapshotStore(buffer, background=False).export(step)
        except (SnapshotMissing, SnapshotCorrupt):
            time.sleep(0.05)
        finally:
            buffer.close()
    return None


class DurableCheckpoints:
    def __init__(self, writer: CheckpointWriter, events: EventLog, steps: int) -> None:
        self.writer, self.events, self.steps = writer, events, steps
        self._threads: list[threading.Thread] = []

    def after_commit(self, snapshot: Path, done: int) -> None:
        """Checkpoint step `done` if it is due (every K steps, and the last step)."""
        if self.writer.due(done) or done == self.steps:
            thread = threading.Thread(target=self._write, args=(snapshot, done), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _write(self, snapshot: Path, done: int) -> None:
        blob = export_step(snapshot, done)
        if blob is None:
            log.warning("no verified snapshot of step %d to checkpoint", done)
            return
        self.writer.submit(done, blob)
        self.events.write(EventKind.CHECKPOINT_SUBMITTED, step=done, url=self.writer.url)

    def close(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout=5.0)
        self.writer.close(timeout=timeout)
