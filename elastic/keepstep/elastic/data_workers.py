"""Reading micro-batches in worker processes, each read in its keyed RNG scope.

Where it sits: ``MicroBatchLoader`` (data.py) with ``workers > 0`` hands the micro-batches
it reads ahead to a ``Readers`` pool instead of threads; ``get`` waits for the one the
training thread asks for.

Why processes: decoding and augmenting samples in Python (images, audio) holds the GIL, so
reader threads do not run beside the forward; a ``DataLoader`` uses processes for that
(``num_workers``). And in a process of its own a read can be keyed like one in the
training thread: each worker enters ``rng_scope(seed, step, micro-batch, DATA)`` around
its read, so torch's, ``random``'s and numpy's global generators draw exactly what the
training thread would have drawn there, and random augmentation gives the same bits read
anywhere (threads cannot: the generators are process-wide).

How: the workers are forked when the job starts (``keepstep.init``, before the job's
communicator and its threads exist), so the dataset and collate function are inherited,
not pickled. Tasks go down one queue (the children trust their parent); each worker sends
its results up a pipe of its own as bytes: a JSON header naming the micro-batch, then the
batch in batch_wire.py's fixed layout (tensors and plain values), so nothing a worker
sends is unpickled here. A guess the
plan drops is still read by some worker and its result discarded on arrival. A worker that
dies (killed, out of memory) is noticed while a read is awaited: the pool is shut and the
loader reads in the training thread from then on, which gives the same bits.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import struct
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import connection
from typing import Any

from keepstep.elastic.batch_wire import decode, encode
from keepstep.elastic.errors import ConfigError, KeepstepError
from keepstep.elastic.rng import DATA, rng_scope

__all__ = ["Readers", "WorkersLost"]

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (step, micro-batch id)
_POLL_S = 0.5  # how often a wait looks at the workers' health
_STOP_S = 5.0  # how long close() waits for a worker before it is terminated


class WorkersLost(KeepstepError):
    """A reader process died: the caller reads in its own thread from now on."""


def _message(key: Key, indices: tuple[int, ...], error: str | None, batch: bytes) -> bytes:
    meta = json.dumps({"key": list(key), "indices": list(indices), "error": error}).encode()
    return struct.pack("<I", len(meta)) + meta + batch


def _serve(
    dataset: Any, collate: Callable[[list[Any]], Any], seed: int, tasks: Any, results: Any
) -> None:
    """A worker's loop: read each task's micro-batch in its keyed scope, until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the training process died without close()
                return
            continue
        if task is None:
            return
        key, indices = task
        try:
            # device_generators=(): a forked child never touches the parent's CUDA context.
            with rng_scope(seed, key[0], key[1], device_generators=(), purpose=DATA):
                batch = collate([dataset[i] for i in indices])
            message = _message(key, indices, None, encode(batch))
        except BaseException:
            message = _message(key, indices, traceback.format_exc(), b"")
        results.send_bytes(message)


class Readers:
    """``workers`` forked reader processes, and the results they sent back."""

    def __init__(
        self, dataset: Any, collate: Callable[[list[Any]], Any], seed: int, workers: int
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"loader_workers={workers!r} must be an int >= 1")
        if "fork" not in multiprocessing.get_all_start_methods():
            raise ConfigError("loader_workers needs fork() (Linux); use prefetch threads here")
        ctx = multiprocessing.get_context("fork")
        self._tasks = ctx.Queue()  # down to the children: they trust their parent
        pipes = [ctx.Pipe(duplex=False) for _ in range(workers)]  # up: bytes only
        self._results = [receiver for receiver, _ in pipes]
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(dataset, collate, seed, self._tasks, sender),
                name=f"keepstep-reader-{i}",
                daemon=True,
            )
            for i, (_, sender) in enumerate(pipes)
        ]
        for proc in self._procs:
            proc.start()
        for _, sender in pipes:
            sender.close()  # the child's end: a child's exit then reads as EOF here
        self._ready: dict[tuple[Key, tuple[int, ...]], tuple[str | None, bytes]] = {}

    def submit(self, key: Key, indices: Sequence[int]) -> None:
        self._tasks.put((key, tuple(indices)))

    def wait(
        self, key: Key, indices: Sequence[int], wanted: Callable[[Key], bool], timeout: float | None
    ) -> Any:
        """The batch of ``key`` read from ``indices``; results for keys ``wanted`` rejects
        are dropped as they arrive. ``WorkersLost`` if a worker died; the reader's own
        exception is re-raised as a ``KeepstepError`` with its traceback."""
        target = (key, tuple(indices))
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_alive()  # one that died idle would otherwise go unseen while others serve
        while target not in self._ready:
            ready = connection.wait(self._results, timeout=_POLL_S)
            if not ready:
                self._check_alive()  # one that died holding this task
                if deadline is not None and time.monotonic() > deadline:
                    raise KeepstepError(
                        f"micro-batch {key} not read by the loader workers in {timeout} s"
                    )
            for receiver in ready:
                try:
                    raw = receiver.recv_bytes()  # type: ignore[union-attr]
                except EOFError:
                    self._check_alive()
                    raise WorkersLost("loader worker lost (its pipe closed)") from None
                (size,) = struct.unpack_from("<I", raw)
                meta = json.loads(raw[4 : 4 + size])
                got = (tuple(meta["key"]), tuple(meta["indices"]))
                if got == target or wanted(got[0]):
                    self._ready[got] = (meta["error"], raw[4 + size :])
        error, batch = self._ready.pop(target)
        if error is not None:
            raise KeepstepError(f"reading micro-batch {key} in a loader worker failed:\n{error}")
        return decode(batch)  # tensors and plain values only (batch_wire.py)

    def _check_alive(self) -> None:
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            codes = ", ".join(f"{p.name} exited {p.exitcode}" for p in dead)
            raise WorkersLost(f"loader worker lost ({codes})")

    def forget(self, wanted: Callable[[Key], bool]) -> None:
        """Drop results already here for keys no longer wanted."""
        for held in [k for k in self._ready if not wanted(k[0])]:
            del self._ready[held]

    def close(self) -> None:
        """Stop the workers: ask, wait up to ``_STOP_S``, then terminate."""
        for _ in self._procs:
            try:
                self._tasks.put_nowait(None)
            except (ValueError, OSError):  # the queue is already closed
                break
        deadline = time.monotonic() + _STOP_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(_STOP_S)
        self._tasks.cancel_join_thread()  # never block the exit on tasks no one will read
        self._tasks.close()
        for receiver in self._results:
            receiver.close()
        self._results = []
        self._procs = []
        self._ready.clear()
