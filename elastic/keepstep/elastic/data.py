"""Turning (step, micro-batch) into a batch: the loader, its prefetch, and sources of any size.

Where it sits: `Step.micro_batches()` asks the job's `MicroBatchLoader` for each of its
micro-batches. Which samples a micro-batch reads is `SampleOrder`'s (rng.py), a pure
function of (seed, step, micro-batch id); the loader only reads them (`dataset[i]` and the
collate function). With `prefetch > 0` it reads ahead on background threads: the rest of
the step's micro-batches, and the next step's under the current plan. A guess that the
plan then changes (a membership change, a retry) is dropped unread: what a micro-batch
holds never depends on when or where it was read, so prefetching cannot change a number.

That is also what makes a source resumable: the job's position is its step, and the
samples of any step are known without reading the ones before it. `TokenFile` and
`TokenShards` are such sources for token streams of any size: memory-mapped, so only the
pages a micro-batch touches are read.

A random augmentation in `__getitem__` or the collate function draws keyed numbers: the
training thread reads each micro-batch in its own RNG scope, keyed by (seed, step,
micro-batch) apart from the forward's, so every member augments a micro-batch alike. With
prefetch the reads run on background threads, where the process-wide generators cannot be
keyed: the dataset must then draw nothing from them (checked on sample 0 at start) and be
safe to call from another thread (reads of files and arrays are; most datasets are).
With ``workers`` the reads run in forked processes instead (data_workers.py), each keyed
like the training thread's, so a dataset may draw there and reads in Python run beside
the forward.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keepstep.elastic.data_workers import Readers, WorkersLost
from keepstep.elastic.errors import ConfigError

log = logging.getLogger(__name__)

Collate = Callable[[list[Any]], Any]
Key = tuple[int, int]  # (step, micro-batch id)


def check_dataset(dataset: object) -> None:
    """``ConfigError`` naming what the job cannot read by position: a DataLoader (its
    dataset is), an iterable-style dataset, anything without ``len`` and ``[i]``."""
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise ConfigError(
            "the dataset is a DataLoader: the job picks every micro-batch's samples itself "
            "(keyed by seed and step, so any member can read any micro-batch). Pass its "
            "dataset and collate function, keepstep.init(model, optimizer, loader.dataset, "
            "collate_fn=loader.collate_fn, ...): its sampler, shuffle and batch size are "
            "replaced by the job's order, global_batch and micro_batch"
        )
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ConfigError(
            f"the dataset is an iterable-style {type(dataset).__name__}: the job reads by "
            "position (len and dataset[i]), so that a joiner or a restarted worker reads "
            "exactly where the job is. For token streams, keepstep.elastic.data.TokenFile "
            "or TokenShards read files of any size by position"
        )
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(dataset, m)]
    if missing:
        raise ConfigError(
            f"the dataset ({type(dataset).__name__}) has no {' or '.join(missing)}: the job "
            "reads a map-style dataset, len(dataset) samples read as dataset[i]"
        )


def _global_states() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def check_reads_draw_nothing(dataset: Any, collate: Collate) -> None:
    """With prefetch, reads run on another thread, where the global generators cannot be
    keyed per micro-batch (they are process-wide, and the forward draws from them at the
    same time). ``ConfigError`` if reading sample 0 draws from torch's, ``random``'s or
    numpy's global generator; the generators are put back as they were."""
    before = _global_states()
    try:
        collate([dataset[0]])
        after = _global_states()
    finally:
        torch.set_rng_state(before[0])
        random.setstate(before[1])
        np.random.set_state(before[2])
    drew = [
        name
        for name, was, now in zip(("torch", "random", "numpy"), before, after, strict=True)
        if not _same_state(was, now)
    ]
    if drew:
        raise ConfigError(
            f"reading dataset[0] draws from {' and '.join(drew)}'s global generator (a random "
            "augmentation in __getitem__ or collate_fn?). With prefetch the reads run on a "
            "background thread, where those draws cannot be keyed by (seed, step, "
            "micro-batch) and members would augment differently. Use loader_workers=N "
            "(reads in worker processes are keyed), prefetch=0 (reads in the training thread "
            "are keyed), or draw from a generator seeded by the index"
        )


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):  # numpy's: (name, keys, pos, ...)
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


class MicroBatchLoader:
    """Reads micro-batches, optionally ahead of the training thread.

    ``prefetch``: how many micro-batches may be read ahead (0: read on demand, in the
    training thread); ``threads``: the background readers (default: 1, or 2 when
    prefetching 4 or more). ``workers`` > 0 reads ahead in that many forked processes
    instead (data_workers.py), each read keyed by ``seed`` like the training thread's;
    ``prefetch`` then defaults to two micro-batches a worker.
    """

    def __init__(
        self,
        dataset: Any,
        collate: Collate,
        prefetch: int = 0,
        threads: int | None = None,
        workers: int = 0,
        seed: int = 0,
    ) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigError(f"prefetch={prefetch!r} must be an int >= 0 (micro-batches ahead)")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"loader threads={threads!r} must be an int >= 1")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"loader_workers={workers!r} must be an int >= 0 (processes)")
        check_dataset(dataset)
        if workers and not prefetch:
            prefetch = 2 * workers
        if prefetch and not workers:
            check_reads_draw_nothing(dataset, collate)
        self.dataset, self.collate, self.prefetch = dataset, collate, prefetch
        self._pending: OrderedDict[Key, tuple[tuple[int, ...], Future[Any] | None]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._readers: Readers | None = None
        if workers:
            self._readers = Readers(dataset, collate, seed, workers)
        elif prefetch:
            count = threads if threads is not None else (2 if prefetch >= 4 else 1)
            self._pool = ThreadPoolExecutor(count, thread_name_prefix="keepstep-loader")
        self.hits = 0  # micro-batches that were ready (or in flight) when asked for
        self.misses = 0

    def read(self, indices: Sequence[int]) -> Any:
        return self.collate([self.dataset[i] for i in indices])

    def ahead(self, planned: Sequence[tuple[Key, Sequence[int]]]) -> None:
        """Start reading the micro-batches `planned` (in the order they will be asked for),
        up to `prefetch` of them in flight or ready; guesses no longer planned are dropped."""
        if self._pool is None and self._readers is None:
            return
        wanted = dict(planned[: self.prefetch])
        for key in [k for k in self._pending if k not in wanted]:
            _, future = self._pending.pop(key)
            if future is not None:
                future.cancel()  # read already, or being read: dropped when done
        for key, indices in wanted.items():
            held = self._pending.get(key)
            if held is not None and held[0] == tuple(indices):
                continue
            if self._readers is not None:
                self._readers.submit(key, indices)
                self._pending[key] = (tuple(indices), None)
            else:
                assert self._pool is not None
                future = self._pool.submit(self.read, tuple(indices))
                self._pending[key] = (tuple(indices), future)
        if self._readers is not None:
            self._readers.forget(lambda k: k in self._pending)

    def get(self, key: Key, indices: Sequence[int], timeout: float | None = None) -> Any:
        """The batch of micro-batch `key` (step, id) made of `indices`: the prefetched one
        if it was read from the same indices, else read now."""
        held = self._pending.pop(key, None)
        if held is not None and held[0] == tuple(indices):
            future = held[1]
            if future is not None:
                self.hits += 1
                return future.result(timeout)  # a reader's exception is raised here
            if self._readers is not None:
                try:
                    batch = self._readers.wait(key, indices, lambda k: k in self._pending, timeout)
                    self.hits += 1
                    return batch
                except WorkersLost as lost:
                    log.warning("%s: reading in the training thread from now on", lost)
                    self._readers.close()
                    self._readers = None
        self.misses += 1
        return self.read(indices)

    def close(self) -> None:
        for _, future in self._pending.values():
            if future is not None:
                future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._readers is not None:
            self._readers.close()
            self._readers = None


class TokenFile:
    """A flat file of token ids (raw, little-endian `dtype`) as samples of `seq` tokens:
    sample i is (tokens[i*seq : i*seq+seq], the same shifted by one), as int64 tensors.
    Memory-mapped: a file of any size opens at once and a sample reads only its pages."""

    def __init__(self, path: str | os.PathLike[str], seq: int, dtype: str = "uint16") -> None:
        if not isinstance(seq, int) or seq < 1:
            raise ConfigError(f"seq={seq!r} must be an int >= 1 (tokens per sample)")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise ConfigError(f"dtype={dtype!r} is not a numpy dtype (uint16, uint32...)") from None
        if self.dtype.kind not in "ui":
            raise ConfigError(f"dtype={dtype!r}: token ids are integers (uint16, uint32...)")
        self.path, self.seq = Path(path), seq
        if not self.path.is_file():
            raise ConfigError(f"token file {str(self.path)!r} does not exist")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ConfigError(
                f"token file {str(self.path)!r}: {size} bytes is not a whole number of "
                f"{self.dtype.name} tokens"
            )
        self.n_tokens = size // self.dtype.itemsize
        # The last sample needs one token past its end (its last target).
        self._len = max(0, (self.n_tokens - 1) // seq)
        if self._len == 0:
            raise ConfigError(
                f"token file {str(self.path)!r} holds {self.n_tokens} tokens: fewer than one "
                f"sample of seq={seq} (+1)"
            )
        self._tokens: np.memmap[Any, Any] | None = None

    def _mapped(self) -> np.memmap[Any, Any]:
        # Opened lazily: a dataset handed to another process maps the file there.
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} of {self._len}")
        row = torch.from_numpy(
            self._mapped()[i * self.seq : (i + 1) * self.seq + 1].astype(np.int64)
        )
        return row[:-1], row[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


class TokenShards:
    """Several token files (shards, in order) as one index space: sample i lies in the shard
    whose cumulative sample count passes i. Shards open on first use and stay mapped (up to
    `open_shards` of them, least recently used first out)."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        seq: int,
        dtype: str = "uint16",
        open_shards: int = 64,
    ) -> None:
        if not paths:
            raise ConfigError("TokenShards needs at least one shard path")
        if not isinstance(open_shards, int) or open_shards < 1:
            raise ConfigError(f"open_shards={open_shards!r} must be an int >= 1")
        self.shards = [TokenFile(p, seq, dtype) for p in paths]
        self.starts: list[int] = []
        total = 0
        for shard in self.shards:
            self.starts.append(total)
            total += len(shard)
        self._len = total
        self.open_shards = open_shards
        self._open: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()  # prefetch threads read concurrently

    def __len__(self) -> int:
        return self._len

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, sample within it) of sample `i`: the source's cursor for `i`."""
        if not 0 <= i < self._len:
            raise IndexError(f"sample {i} of {self._len}")
        k = bisect.bisect_right(self.starts, i) - 1
        return k, i - self.starts[k]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, j = self.locate(i)
        with self._lock:
            self._open[k] = None
            self._open.move_to_end(k)
            while len(self._open) > self.open_shards:
                old, _ = self._open.popitem(last=False)
                # Unmapped once no reader holds it (samples are copies, never views).
                self.shards[old]._tokens = None
        return self.shards[k][j]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
