"""The abort watch: an abort is pushed to every rank, reads of the store are rare, and a
store that stops answering is still found."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import HashStore, Store, TCPStore

from keepstep.elastic.comm import abort_epoch, abort_key, wake_key
from keepstep.elastic.comm import watch as comm_watch
from keepstep.elastic.comm.exit_guard import ExitGuard
from keepstep.elastic.comm.watch import AbortWatch, Outcome
from keepstep.elastic.errors import ConfigError


class CountingStore(Store):
    """A HashStore that counts the abort-key reads made through it."""

    def __init__(self, inner: HashStore) -> None:
        super().__init__()
        self.inner = inner
        self.reads = 0
        self.read_at: list[float] = []
        self._lock = threading.Lock()

    def clone(self) -> CountingStore:
        return self  # one counter for every connection

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            self.reads += 1
            self.read_at.append(time.monotonic())
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self.inner.wait(keys, timeout or timedelta(seconds=300))

    def set(self, key: str, value: str) -> None:  # type: ignore[override]
        self.inner.set(key, value)

    def multi_set(self, keys: list[str], values: list[str]) -> None:  # type: ignore[override]
        self.inner.multi_set(keys, values)

    def get(self, key: str) -> bytes:
        return bytes(self.inner.get(key))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


@pytest.fixture
def watched() -> Iterator[tuple[CountingStore, AbortWatch]]:
    """A counting store and the abort watch of its epoch 0, closed after the test."""
    store = CountingStore(HashStore())
    watch = AbortWatch(store, 0, 0, 1)
    yield store, watch
    watch.close()


def _armed(watch: AbortWatch) -> None:
    deadline = time.monotonic() + 5.0
    while not watch.pushed:
        assert time.monotonic() < deadline, "the listener never began to wait"
        time.sleep(0.001)


def _never_done(slices: list[int]) -> Callable[[int], bool]:
    def ready(slice_ms: int) -> bool:
        slices.append(slice_ms)
        time.sleep(slice_ms / 1000)
        return False

    return ready


def test_looks_between_wait_slices_read_the_store_at_most_every_interval(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    store, watch = watched
    start = time.monotonic()
    looks = 0
    while time.monotonic() - start < 0.3:
        assert watch.poll() is None
        looks += 1
        time.sleep(0.0005)
    elapsed = time.monotonic() - start
    bound = elapsed / comm_watch.POLL_INTERVAL_S + 2
    assert looks > 5 * bound  # the caller looked far more often than the store was read
    assert 1 <= store.reads <= bound, (store.reads, bound)


def test_looks_between_micro_batches_read_the_store_less_often(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    store, watch = watched
    start = time.monotonic()
    while time.monotonic() - start < 0.5:
        assert watch.poll(every=comm_watch.COMPUTE_POLL_INTERVAL_S) is None
        time.sleep(0.0005)
    bound = (time.monotonic() - start) / comm_watch.COMPUTE_POLL_INTERVAL_S + 2
    assert 1 <= store.reads <= bound, (store.reads, bound)


def test_a_waiting_poll_always_reads_afresh(watched: tuple[CountingStore, AbortWatch]) -> None:
    store, watch = watched
    for _ in range(5):
        assert watch.poll(wait=1.0) is None
    assert store.reads == 5
    abort_epoch(store.inner, 0, "rank 1 died", 1)
    assert watch.poll(wait=1.0) == "rank 1 died"


def test_an_abort_is_seen_within_about_one_interval(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    store, watch = watched
    assert watch.poll(wait=1.0) is None
    abort_epoch(store.inner, 0, "agent: node lost", 1)
    written = time.monotonic()
    while watch.poll() is None:
        assert time.monotonic() - written < 2.0
        time.sleep(0.001)
    # An interval plus the store's round trip and the thread wake-ups (slack for a
    # loaded machine).
    assert time.monotonic() - written < comm_watch.POLL_INTERVAL_S + 0.5


def test_waits_sleep_long_between_reads_and_come_back_soon_for_an_answer(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    store, watch = watched
    slices: list[int] = []
    never_done = _never_done(slices)
    outcome = watch.wait(never_done, time.monotonic() + 0.5, threading.Event())
    assert outcome is Outcome.TIMED_OUT
    long, short = comm_watch.SLICE_LONG_MS, comm_watch.SLICE_SHORT_MS
    assert set(slices) == {short, long}
    # Most of the wait is spent in long slices: a few dozen slices run out in 0.5 s, not
    # hundreds. A short one follows each read asked for.
    assert slices.count(long) >= 0.4 * 500 / long - 2 and len(slices) < 3 * 500 / long
    assert 1 <= store.reads <= slices.count(short) + 1
    # An abort written meanwhile is still found within about one interval and a read.
    abort_epoch(store.inner, 0, "rank 2 hangs", 1)
    begun = time.monotonic()
    assert watch.wait(never_done, begun + 2.0, threading.Event()) is Outcome.ABORTED
    assert time.monotonic() - begun < comm_watch.POLL_INTERVAL_S + long / 1000 + 0.5


def test_a_pushed_abort_ends_a_wait_at_once_without_a_read(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    store, watch = watched
    _armed(watch)
    reads = store.reads
    timer = threading.Timer(0.05, abort_epoch, (store.inner, 0, "agent: node lost", 1))
    timer.start()
    begun = time.monotonic()
    outcome = watch.wait(_never_done([]), begun + 5.0, threading.Event())
    assert outcome is Outcome.ABORTED and watch.reason == "agent: node lost"
    assert time.monotonic() - begun < comm_watch.PUSH_TRUSTED_S
    assert store.reads == reads  # heard, not read
    timer.join()


def test_a_long_wait_reads_the_store_once_the_push_is_no_longer_trusted(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    # A push cannot tell that the store stopped answering: a wait that lasts reads it.
    store, watch = watched
    _armed(watch)
    store.read_at.clear()
    begun = time.monotonic()
    outcome = watch.wait(_never_done([]), begun + 0.6, threading.Event())
    assert outcome is Outcome.TIMED_OUT
    assert store.read_at, "a long wait never read the store"
    assert min(store.read_at) - begun >= comm_watch.PUSH_TRUSTED_S - 0.01
    assert len(store.read_at) <= 0.6 / comm_watch.POLL_INTERVAL_S + 2


def test_close_lets_the_listener_go_without_aborting_the_epoch() -> None:
    store = HashStore()
    watch = AbortWatch(store, 3, 1, 2)
    _armed(watch)
    watch.close()
    assert watch.listened.wait(5.0)
    assert not watch.pushed and watch.reason is None
    assert store.check([wake_key(3, 1)]) and not store.check([wake_key(3, 0)])
    assert not store.check([abort_key(3)])


def test_a_closed_watch_answers_polls_without_asking_the_store(
    watched: tuple[CountingStore, AbortWatch],
) -> None:
    # A finished worker stops its last epoch's watch before its store connections are
    # shut; a collective after its loop must neither read the store nor time out on it.
    store, watch = watched
    _armed(watch)
    watch.close()
    assert watch.listened.wait(5.0)
    reads = store.reads
    began = time.monotonic()
    assert watch.poll(wait=1.0) is None
    assert watch.check(fresh=True) is None
    assert time.monotonic() - began < 0.5 and store.reads == reads
    outcome = watch.wait(_never_done([]), time.monotonic() + 0.2, threading.Event())
    assert outcome is Outcome.TIMED_OUT  # a collective's own deadline still ends it
    assert store.reads == reads and watch.reason is None


def test_at_exit_the_guard_lets_listeners_go_and_admits_no_more_store_calls() -> None:
    store = CountingStore(HashStore())
    guard = ExitGuard()
    watch = AbortWatch(store, 7, 0, 1, guard)
    _armed(watch)
    begun = time.monotonic()
    guard.close()  # what atexit runs
    assert time.monotonic() - begun < 1.0
    assert watch.listened.is_set() and watch.reason is None
    assert not store.inner.check([abort_key(7)])
    # A watch started after exit began never enters the store: its threads just end.
    late = AbortWatch(store, 8, 0, 1, guard)
    assert late.listened.wait(5.0)
    reads = store.reads
    assert late.poll(wait=0.2) is None
    assert store.reads == reads


def test_abort_epoch_wants_the_number_of_ranks() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="ranks must be an int >= 1"):
            abort_epoch(HashStore(), 0, "x", bad)  # type: ignore[arg-type]


@pytest.fixture
def tcp() -> Iterator[tuple[TCPStore, Callable[[], TCPStore]]]:
    """A real store server on loopback and a way to open clients of it."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def client() -> TCPStore:
        return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))

    yield server, client


def _settled(watches: Sequence[AbortWatch], within: float) -> list[str | None]:
    deadline = time.monotonic() + within
    while any(w.reason is None for w in watches) and time.monotonic() < deadline:
        time.sleep(0.001)
    return [w.reason for w in watches]


def test_every_rank_hears_an_abort_over_a_real_store(
    tcp: tuple[TCPStore, Callable[[], TCPStore]],
) -> None:
    _, client = tcp
    watches = [AbortWatch(client(), 5, rank, 3) for rank in range(3)]
    for watch in watches:
        _armed(watch)
    written = time.monotonic()
    abort_epoch(client(), 5, "agent: node n2 lost its lease", 3)
    # Nobody polls: the reasons arrive by themselves.
    assert _settled(watches, 5.0) == ["agent: node n2 lost its lease"] * 3
    print(f"all ranks heard the abort {1000 * (time.monotonic() - written):.1f} ms after it")
    assert all(w.listened.wait(5.0) for w in watches)


def test_a_rank_that_gives_up_wakes_the_others(
    tcp: tuple[TCPStore, Callable[[], TCPStore]],
) -> None:
    _, client = tcp
    first, other = AbortWatch(client(), 0, 0, 2), AbortWatch(client(), 0, 1, 2)
    _armed(other)
    assert first.fire("rank 0 (a): allreduce failed") == "rank 0 (a): allreduce failed"
    assert _settled([other], 5.0) == ["rank 0 (a): allreduce failed"]
    first.close()
    other.close()


def test_the_listener_gives_up_when_the_store_goes_away() -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    watch = AbortWatch(client, 0, 0, 2)
    _armed(watch)
    del server  # its node went away: the listener's connection is closed under it
    (reason,) = _settled([watch], 5.0)
    assert reason is not None and reason.startswith("the epoch's store failed"), reason


class SlowStore(CountingStore):
    """A store whose reads take `delay` s to answer (its node is busy, not gone)."""

    def __init__(self, inner: HashStore, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def check(self, keys: list[str]) -> bool:
        time.sleep(self.delay)
        return super().check(keys)


@pytest.mark.parametrize(
    ("store_timeout", "aborted"), [(0.2, True), (1.0, False)], ids=["default", "raised"]
)
def test_a_raised_store_timeout_outlasts_a_slow_store(store_timeout: float, aborted: bool) -> None:
    # A read answered in 0.5 s: within a raised bound the epoch goes on; within the
    # default one (scaled down here to keep the test short) it is taken for a lost store.
    store = SlowStore(HashStore(), delay=0.5)
    watch = AbortWatch(store, 0, 0, 1, store_timeout=timedelta(seconds=store_timeout))
    try:
        deadline = time.monotonic() + 1.5
        reason = watch.poll(wait=0.01)
        while reason is None and time.monotonic() < deadline and store.reads == 0:
            reason = watch.poll(wait=0.05)
        reason = watch.poll()
    finally:
        watch.close()
    if aborted:
        assert reason == "the epoch's store did not answer within 0.2 s (its node died or hangs)"
    else:
        assert reason is None and store.reads >= 1


def test_a_store_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="store_timeout"):
        AbortWatch(CountingStore(HashStore()), 0, 0, 1, store_timeout=timedelta(0))
