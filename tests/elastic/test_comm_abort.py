"""The abort watch: how often it reads the epoch's store, and that it still sees an abort."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import HashStore, Store

from keepstep.elastic import comm_abort
from keepstep.elastic.comm_abort import _AbortWatch, abort_epoch


class CountingStore(Store):
    """A HashStore that counts the abort-key reads made through it."""

    def __init__(self, inner: HashStore) -> None:
        super().__init__()
        self.inner = inner
        self.reads = 0
        self._lock = threading.Lock()

    def clone(self) -> CountingStore:
        return self  # one counter for every connection

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            self.reads += 1
        return bool(self.inner.check(keys))

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


@pytest.fixture
def watched() -> Iterator[tuple[CountingStore, _AbortWatch]]:
    """A counting store and the abort watch of its epoch 0, closed after the test."""
    store = CountingStore(HashStore())
    watch = _AbortWatch(store, 0)
    yield store, watch
    watch.close()


def test_looks_between_wait_slices_read_the_store_at_most_every_interval(
    watched: tuple[CountingStore, _AbortWatch],
) -> None:
    store, watch = watched
    start = time.monotonic()
    looks = 0
    while time.monotonic() - start < 0.3:
        assert watch.poll() is None
        looks += 1
        time.sleep(0.0005)
    elapsed = time.monotonic() - start
    bound = elapsed / comm_abort._POLL_INTERVAL_S + 2
    assert looks > 5 * bound  # the caller looked far more often than the store was read
    assert 1 <= store.reads <= bound, (store.reads, bound)


def test_looks_between_micro_batches_read_the_store_less_often(
    watched: tuple[CountingStore, _AbortWatch],
) -> None:
    store, watch = watched
    start = time.monotonic()
    while time.monotonic() - start < 0.5:
        assert watch.poll(every=comm_abort._COMPUTE_POLL_INTERVAL_S) is None
        time.sleep(0.0005)
    bound = (time.monotonic() - start) / comm_abort._COMPUTE_POLL_INTERVAL_S + 2
    assert 1 <= store.reads <= bound, (store.reads, bound)


def test_a_waiting_poll_always_reads_afresh(watched: tuple[CountingStore, _AbortWatch]) -> None:
    store, watch = watched
    for _ in range(5):
        assert watch.poll(wait=1.0) is None
    assert store.reads == 5
    abort_epoch(store.inner, 0, "rank 1 died")
    assert watch.poll(wait=1.0) == "rank 1 died"


def test_an_abort_is_seen_within_about_one_interval(
    watched: tuple[CountingStore, _AbortWatch],
) -> None:
    store, watch = watched
    assert watch.poll(wait=1.0) is None
    abort_epoch(store.inner, 0, "agent: node lost")
    written = time.monotonic()
    while watch.poll() is None:
        assert time.monotonic() - written < 2.0
        time.sleep(0.001)
    # An interval plus the store's round trip and the thread wake-ups (slack for a
    # loaded machine).
    assert time.monotonic() - written < comm_abort._POLL_INTERVAL_S + 0.5


def test_waits_sleep_long_between_reads_and_come_back_soon_for_an_answer(
    watched: tuple[CountingStore, _AbortWatch],
) -> None:
    store, watch = watched
    slices: list[int] = []

    def never_done(slice_ms: int) -> bool:
        slices.append(slice_ms)
        time.sleep(slice_ms / 1000)
        return False

    outcome = watch.wait(never_done, time.monotonic() + 0.5, threading.Event())
    assert outcome is comm_abort._Outcome.TIMED_OUT
    long, short = comm_abort._SLICE_LONG_MS, comm_abort._SLICE_SHORT_MS
    assert set(slices) == {short, long}
    # Most of the wait is spent in long slices: a few dozen slices run out in 0.5 s, not
    # hundreds. A short one follows each read asked for.
    assert slices.count(long) >= 0.4 * 500 / long - 2 and len(slices) < 3 * 500 / long
    assert 1 <= store.reads <= slices.count(short) + 1
    # An abort written meanwhile is still found within about one interval and a read.
    abort_epoch(store.inner, 0, "rank 2 hangs")
    begun = time.monotonic()
    assert watch.wait(never_done, begun + 2.0, threading.Event()) is comm_abort._Outcome.ABORTED
    assert time.monotonic() - begun < comm_abort._POLL_INTERVAL_S + long / 1000 + 0.5
