"""Durable checkpoints: one snapshot slot written every K steps to any fsspec URL.

Where it sits: beside the node agent's snapshot buffer ("Failure and growth" in
ARCHITECTURE.md). Workers commit every step into the node's shared-memory SnapshotStore; the
agent opens the same buffer and, when ``CheckpointWriter.due(step)``, hands
``store.export(step)`` to ``submit``. One background thread writes it, so neither the training
process nor the agent's loop waits on storage. ``keepstep run --resume URL`` calls
``latest_checkpoint`` and feeds the blob to ``SnapshotStore.import_``. Checkpoints serve
whole-job restarts only: a lost node is healed from its peers' snapshots, never from here.

This module is the public face: the writer is here, the readers are in ``checkpoint_read``,
and the layout, records and storage calls are in ``checkpoint_io``; every public name is
importable from here. Layout under the URL (a directory, or a prefix in an object store)::

    step-00000042.ckpt   the blob: a verified snapshot slot (header + payload)
    step-00000042.json   its CheckpointInfo, with the blob's sha256
    latest.json          the CheckpointInfo of the newest complete checkpoint, written last

A checkpoint exists for readers only once latest.json names it or a later step, so a writer
that dies part-way leaves files no reader returns. Object stores publish each object whole; on a
local filesystem each file goes to a temporary name, is fsynced and renamed. Checkpoints older
than the newest ``keep`` are deleted after latest.json has moved on.

S3 endpoints and credentials come in ``storage_options``
(``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``); the CLI reads them
from the environment, these modules never do.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from keepstep.agent.durable.parts import Part, publish_parts, write_part
from keepstep.agent.durable.reader import latest_checkpoint, list_checkpoints
from keepstep.agent.durable.storage import (
    LATEST,
    TMP_FILE,
    CheckpointInfo,
    Location,
    Store,
    blob_name,
    check_int,
    check_timeout,
    info_name,
    step_files,
)
from keepstep.errors import ConfigError, KeepstepError

__all__ = [
    "LATEST",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWriter",
    "Part",
    "blob_name",
    "info_name",
    "latest_checkpoint",
    "list_checkpoints",
]

log = logging.getLogger(__name__)


class CheckpointError(KeepstepError):
    """A checkpoint could not be written (``step``: which), or the writer was used after
    ``close``."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class _Blob:
    """A submitted blob and who to tell once nothing reads it any more (``on_done``)."""

    step: int
    data: bytes | bytearray | None
    part: Part | None
    on_done: Callable[[], None] | None

    def drop(self) -> None:
        """Let go of the bytes and tell the submitter (once)."""
        self.data = None
        done, self.on_done = self.on_done, None
        if done is not None:
            done()


class CheckpointWriter:
    """Writes submitted blobs on one background thread; a newer pending blob replaces an older.

    ``after_step`` is the step the job starts or resumes from: it and every step below it are
    never due, so a resumed job does not write its starting checkpoint again. A sharded
    job's members each submit their snapshot as a ``Part`` (parts.py), one writer each; the
    publishing one waits up to ``parts_timeout`` s for the other parts, or until a newer
    step is submitted to it.
    """

    def __init__(
        self,
        url: str,
        every_steps: int,
        *,
        keep: int = 2,
        storage_options: Mapping[str, Any] | None = None,
        after_step: int = 0,
        parts_timeout: float = 300.0,
    ) -> None:
        self._loc = Location.parse(url, storage_options)
        check_int("every_steps", every_steps, 1)
        check_int("keep", keep, 1)
        check_int("after_step", after_step, 0)
        check_timeout(parts_timeout)
        self.parts_timeout = parts_timeout
        self.url = self._loc.url
        self.every_steps = every_steps
        self.keep = keep
        self._cond = threading.Condition()
        self._last = after_step  # newest step written, being written or pending
        # Submitted, not started: the oldest (the thread takes it next) and, while a write
        # is under way, only the newest one besides.
        self._pending: list[_Blob] = []
        self._busy: int | None = None  # the step being written
        self._error: CheckpointError | None = None  # the newest write failed
        self._written: list[CheckpointInfo] = []
        self._closed = False
        # Daemon: a write stuck on a dead endpoint must not keep the process alive at exit;
        # close() is where an orderly exit waits, with a timeout.
        self._thread = threading.Thread(target=self._run, name="keepstep-checkpoint", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        check_int("step", step, 0)
        with self._cond:
            return not self._closed and step % self.every_steps == 0 and step > self._last

    def submit(
        self,
        step: int,
        blob: bytes | bytearray,
        part: Part | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Queue ``blob`` (the raw bytes of ``step``; with ``part``, one member's part of
        it) and return at once. ``on_done`` is called once the writer no longer reads the
        blob (written, failed, or replaced by a newer step); a bytearray must not change
        until then."""
        check_int("step", step, 0)
        if not isinstance(blob, bytes | bytearray):
            raise ConfigError(f"blob: must be bytes or a bytearray, got {type(blob).__name__}")
        with self._cond:
            if self._closed:
                raise CheckpointError(f"checkpoint writer for {self.url} is closed")
            if step <= self._last:
                raise ConfigError(
                    f"step={step}: checkpoint steps must increase; step {self._last} is "
                    "already written or queued"
                )
            busy = self._busy
            # A write under way, or one queued behind the one about to start: storage is
            # slower than the cadence, and the newest step takes the queued one's place.
            queued = self._pending and (busy is not None or len(self._pending) > 1)
            replaced = self._pending.pop() if queued else None
            self._pending.append(_Blob(step, blob, part, on_done))
            self._last = step
            self._cond.notify_all()
        if replaced is not None:  # storage is slower than the cadence; say so, outside the lock
            replaced.drop()
            log.warning(
                "checkpoint of step %d to %s skipped: step %d replaced it while step %s "
                "was being written",
                replaced.step,
                self.url,
                step,
                busy,
            )

    def flush(self, timeout: float) -> None:
        """Wait until everything submitted is in storage; raise CheckpointError if the newest
        write failed (an older failure that a later write superseded was only logged)."""
        check_timeout(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    step = self._pending[-1].step if self._pending else self._busy
                    raise TimeoutError(
                        f"checkpoint of step {step} to {self.url} not written after {timeout} s"
                    )
                self._cond.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def written(self) -> list[CheckpointInfo]:
        """What this writer has put in storage, oldest first (pruned ones included)."""
        with self._cond:
            return list(self._written)

    def close(self, timeout: float) -> None:
        """Write what is pending, then stop the thread; later submits raise CheckpointError."""
        check_timeout(timeout)
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self.flush(timeout)
        finally:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                item = self._pending.pop(0)
                self._busy = step = item.step
            info: CheckpointInfo | None = None
            error: CheckpointError | None = None
            try:
                info = self._write(item) if item.part is None else self._write_part(item, item.part)
            except Exception as e:
                log.error("checkpoint of step %d to %s failed: %r", step, self.url, e)
                error = CheckpointError(
                    f"checkpoint of step {step} to {self.url} failed: {e!r}", step
                )
                error.__cause__ = e
            item.drop()  # the pending slot may already hold the next one; at most three
            del item
            with self._cond:
                self._busy = None
                self._error = error
                if info is not None:
                    self._written.append(info)
                self._cond.notify_all()

    def _write(self, item: _Blob) -> CheckpointInfo:
        started = time.monotonic()
        step, blob = item.step, item.data
        assert blob is not None  # dropped only after the write
        digest = hashlib.sha256(blob).hexdigest()
        store = Store(self._loc)
        store.put(blob_name(step), blob)
        info = CheckpointInfo(
            self._loc.url_of(blob_name(step)), step, len(blob), digest, time.time()
        )
        store.put(info_name(step), info.to_json())
        store.put(LATEST, info.to_json())
        try:
            self._prune(store, step)
        except Exception as e:  # the checkpoint is durable; stale files only cost space
            log.warning("could not delete old checkpoints under %s: %r", self.url, e)
        seconds = time.monotonic() - started
        log.info(
            "checkpoint of step %d: %d B to %s in %.2f s (%.1f MB/s)",
            step,
            len(blob),
            info.url,
            seconds,
            len(blob) / max(seconds, 1e-9) / 1e6,
        )
        return info

    def _write_part(self, item: _Blob, part: Part) -> CheckpointInfo:
        started = time.monotonic()
        step, blob = item.step, item.data
        assert blob is not None  # dropped only after the write
        store = Store(self._loc)
        info = write_part(store, step, part, blob)
        size = len(blob)
        del blob
        item.drop()  # not needed while the other parts are awaited
        log.info(
            "checkpoint of step %d: part %d of %d, %d B to %s in %.2f s",
            step,
            part.index,
            part.count,
            size,
            info.url,
            time.monotonic() - started,
        )
        if not part.publish:
            return info
        info = publish_parts(store, step, part, self.parts_timeout, self._newer)
        log.info("checkpoint of step %d: %d parts published", step, part.count)
        try:
            self._prune(store, step)
        except Exception as e:
            log.warning("could not delete old checkpoints under %s: %r", self.url, e)
        return info

    def _newer(self) -> int | None:
        """The newer step submitted while one is being written, if any."""
        with self._cond:
            return self._pending[-1].step if self._pending else None

    def _prune(self, store: Store, step: int) -> None:
        names = store.names()
        by_step = step_files(names)
        older = sorted(s for s in by_step if s <= step)
        # Parts of later steps without their record are being written now, not another run's.
        newer = [s for s in by_step if s > step and info_name(s) in by_step[s]]
        if newer:
            # Another run's history (a job started on a used URL); latest.json no longer names
            # them, so no reader returns them, and deleting another run's data is not ours.
            log.warning("%s holds checkpoints of later steps %s; left in place", self.url, newer)
        pruned = older[: -self.keep]
        for old in pruned:
            # The record goes first, then the blob (a manifest), then the parts it lists: a
            # listing never shows a record whose blob or parts are gone.
            rank = {info_name(old): 0, blob_name(old): 1}
            for name in sorted(by_step[old], key=lambda n: (rank.get(n, 2), n)):
                store.remove(name)
        # A temporary file of a step pruned here was left by a writer that died mid-file (or
        # one too late to matter). Any other may be another writer's at work: the other
        # members' parts of a newer step, written by other agents into the same directory.
        for name in names:
            tmp = TMP_FILE.fullmatch(name)
            if pruned and tmp is not None and tmp.group(1) and int(tmp.group(1)) <= pruned[-1]:
                store.remove(name)
