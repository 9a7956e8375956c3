"""The KVStore behaviour suite, run against both MemoryKV (fake clock) and EtcdKV (real etcd).

Time is the one difference between the two: a `Backend` either advances the fake clock
and expires leases, or sleeps. The MemoryKV-only tests at the end cover what the fake
adds: the exact clock, several clients and cutting one off.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from keepstep.agent.kv import KV, KVError, KVStore, LeaseLost, MemoryKV, WatchEvent
from keepstep.agent.kv.etcd import EtcdKV
from keepstep.elastic.errors import ConfigError

T = 5.0  # per-call timeout


@dataclass
class FakeClock:
    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Backend:
    kv: KVStore
    prefix: str
    clock: FakeClock | None = None  # None: real time (etcd)
    stores: list[MemoryKV] = field(default_factory=list)

    def elapse(self, seconds: float) -> None:
        if self.clock is None:
            time.sleep(seconds)
            return
        self.clock.t += seconds
        assert isinstance(self.kv, MemoryKV)
        self.kv.expire_leases()

    def eventually(self, predicate: Callable[[], bool], within: float) -> bool:
        """Poll `predicate` while `within` seconds (of this backend's time) pass."""
        waited = 0.0
        while not predicate():
            if waited >= within:
                return False
            self.elapse(0.05)
            waited += 0.05
        return True


@pytest.fixture(params=["memory", "etcd"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    prefix = f"/test/{uuid.uuid4().hex[:12]}/"
    if request.param == "memory":
        clock = FakeClock()
        kv: KVStore = MemoryKV(now=clock)
        yield Backend(kv, prefix, clock)
    else:
        kv = EtcdKV(request.getfixturevalue("etcd_server"), timeout=T)
        yield Backend(kv, prefix)
    kv.close()


class Recorder:
    """Collects watch events from whatever thread delivers them."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.lock = threading.Lock()

    def __call__(self, event: WatchEvent) -> None:
        with self.lock:
            self.events.append(event)

    def seen(self) -> list[tuple[str, str, bytes | None]]:
        with self.lock:
            return [(e.kind, e.key, e.value) for e in self.events]


def test_put_get_and_revisions(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    assert kv.get(p + "a", T) is None
    r1 = kv.put(p + "a", b"one", T)
    r2 = kv.put(p + "a", b"two", T)
    assert r2 > r1 > 0
    assert kv.get(p + "a", T) == KV(p + "a", b"two", r2, None)


def test_get_prefix_is_sorted_and_bounded(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    for name in ["n/b", "n/c", "n/a", "nz", "n"]:
        kv.put(p + name, name.encode(), T)
    got = kv.get_prefix(p + "n/", T)
    assert [x.key for x in got] == [p + "n/a", p + "n/b", p + "n/c"]
    assert [x.value for x in got] == [b"n/a", b"n/b", b"n/c"]
    assert kv.get_prefix(p + "none/", T) == []


def test_create_only_when_absent(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    assert kv.create(p + "k", b"first", T) is True
    assert kv.create(p + "k", b"second", T) is False
    got = kv.get(p + "k", T)
    assert got is not None and got.value == b"first"
    kv.delete(p + "k", T)
    assert kv.create(p + "k", b"again", T) is True


def test_compare_and_put_wins_once_from_a_revision(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    assert kv.compare_and_put(p + "epoch", b"1", 0, T) is True  # 0: must not exist
    assert kv.compare_and_put(p + "epoch", b"1bis", 0, T) is False
    current = kv.get(p + "epoch", T)
    assert current is not None
    assert kv.compare_and_put(p + "epoch", b"2", current.mod_revision, T) is True
    # The same expected revision again is stale now: the second writer loses.
    assert kv.compare_and_put(p + "epoch", b"2bis", current.mod_revision, T) is False
    after = kv.get(p + "epoch", T)
    assert after is not None and after.value == b"2" and after.mod_revision > current.mod_revision


def test_compare_and_put_race_has_exactly_one_winner(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    base = kv.put(p + "epoch", b"0", T)
    wins: list[bytes] = []
    barrier = threading.Barrier(4)

    def contend(i: int) -> None:
        barrier.wait(T)
        if kv.compare_and_put(p + "epoch", f"w{i}".encode(), base, T):
            wins.append(f"w{i}".encode())

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert len(wins) == 1
    got = kv.get(p + "epoch", T)
    assert got is not None and got.value == wins[0]


def test_delete_and_delete_prefix(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    for name in ["d/1", "d/2", "d/3", "keep"]:
        kv.put(p + name, b"x", T)
    assert kv.delete(p + "d/1", T) is True
    assert kv.delete(p + "d/1", T) is False
    assert kv.delete_prefix(p + "d/", T) == 2
    assert kv.delete_prefix(p + "d/", T) == 0
    assert [x.key for x in kv.get_prefix(p, T)] == [p + "keep"]


def test_lease_expiry_removes_keys(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    lease = kv.grant_lease(0.4, T)
    assert lease.ttl == 1.0  # whole seconds, rounded up, as etcd grants them
    kv.put(p + "node", b"alive", T, lease=lease)
    kv.put(p + "plain", b"stays", T)
    got = kv.get(p + "node", T)
    assert got is not None and got.lease == lease.id
    backend.elapse(0.3)
    assert kv.get(p + "node", T) is not None  # well inside the TTL: still there
    assert backend.eventually(lambda: kv.get(p + "node", T) is None, within=4.0)
    assert kv.get(p + "plain", T) is not None
    with pytest.raises(LeaseLost):
        lease.refresh()
    with pytest.raises(LeaseLost):
        kv.put(p + "late", b"x", T, lease=lease)


def test_keepalive_keeps_a_key_past_its_ttl(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    lease = kv.grant_lease(1, T)
    kv.put(p + "node", b"alive", T, lease=lease)
    stop = kv.keepalive(lease, 0.25)
    for _ in range(5):  # 2.5 s in all, 2.5 TTLs
        backend.elapse(0.5)
        assert kv.get(p + "node", T) is not None
    stop()
    stop()  # idempotent
    assert backend.eventually(lambda: kv.get(p + "node", T) is None, within=4.0)


def test_revoke_removes_keys_at_once(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    lease = kv.grant_lease(30, T)
    kv.put(p + "a", b"x", T, lease=lease)
    kv.put(p + "b", b"x", T, lease=lease)
    lease.revoke()
    assert kv.get_prefix(p, T) == []
    lease.revoke()  # already gone: no error


def test_watch_delivers_puts_and_deletes_in_order_until_cancel(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    seen = Recorder()
    cancel = kv.watch_prefix(p + "w/", seen)
    kv.put(p + "w/a", b"1", T)
    kv.put(p + "other", b"ignored", T)
    kv.put(p + "w/b", b"2", T)
    kv.put(p + "w/a", b"3", T)
    kv.delete(p + "w/a", T)
    kv.put(p + "w/c", b"4", T)
    assert kv.delete_prefix(p + "w/", T) == 2
    expected = [
        ("put", p + "w/a", b"1"),
        ("put", p + "w/b", b"2"),
        ("put", p + "w/a", b"3"),
        ("delete", p + "w/a", None),
        ("put", p + "w/c", b"4"),
        ("delete", p + "w/b", None),
        ("delete", p + "w/c", None),
    ]
    assert backend.eventually(lambda: len(seen.seen()) >= len(expected), within=5.0)
    assert seen.seen() == expected
    revisions = [e.revision for e in seen.events]
    assert revisions == sorted(revisions)
    assert revisions[-1] == revisions[-2]  # one delete_prefix, one revision
    assert len(set(revisions)) == len(revisions) - 1  # every other write has its own
    cancel()
    kv.put(p + "w/after", b"late", T)
    marker = Recorder()
    stop_marker = kv.watch_prefix(p + "marker", marker)
    kv.put(p + "marker", b"m", T)  # written after w/after: once seen, w/after was too
    assert backend.eventually(lambda: len(marker.seen()) == 1, within=5.0)
    stop_marker()
    assert len(seen.seen()) == len(expected)


def test_a_watch_below_a_key_sees_only_the_keys_before_it(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    kv.put(p + "a/old", b"0", T)
    kv.put(p + "z/old", b"0", T)
    first = kv.get(p + "a/old", T)
    assert first is not None
    seen = Recorder()
    cancel = kv.watch_prefix(p, seen, start_revision=first.mod_revision, below=p + "m")
    for k in ("a/1", "m/2", "lz/3", "z/4", "m", "l"):
        kv.put(p + k, b"1", T)
    kv.delete(p + "a/1", T)
    expected = [
        ("put", p + "a/old", b"0"),  # replayed history is filtered the same way
        ("put", p + "a/1", b"1"),
        ("put", p + "lz/3", b"1"),
        ("put", p + "l", b"1"),
        ("delete", p + "a/1", None),
    ]
    assert backend.eventually(lambda: len(seen.seen()) >= len(expected), within=5.0)
    marker = Recorder()
    stop_marker = kv.watch_prefix(p + "marker", marker)
    kv.put(p + "marker", b"m", T)  # once seen, every earlier write was delivered
    assert backend.eventually(lambda: len(marker.seen()) == 1, within=5.0)
    assert seen.seen() == expected
    cancel()
    stop_marker()
    for below in (p, "/elsewhere/x", p[:-1]):
        with pytest.raises(ConfigError, match="below="):
            kv.watch_prefix(p, seen, below=below)


def test_watch_from_a_past_revision_replays_history(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    first = kv.put(p + "h/1", b"a", T)
    kv.put(p + "h/2", b"b", T)
    kv.delete(p + "h/1", T)
    seen = Recorder()
    cancel = kv.watch_prefix(p + "h/", seen, start_revision=first + 1)
    kv.put(p + "h/3", b"c", T)
    want = [("put", p + "h/2", b"b"), ("delete", p + "h/1", None), ("put", p + "h/3", b"c")]
    assert backend.eventually(lambda: len(seen.seen()) >= 3, within=5.0)
    assert seen.seen() == want
    cancel()


def test_a_callback_may_cancel_its_own_watch(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    seen = Recorder()
    cancels: list[Callable[[], None]] = []

    def once(event: WatchEvent) -> None:
        seen(event)
        cancels[0]()

    cancels.append(kv.watch_prefix(p + "once/", once))
    kv.put(p + "once/a", b"1", T)
    assert backend.eventually(lambda: len(seen.seen()) == 1, within=5.0)
    kv.put(p + "once/b", b"2", T)
    marker = Recorder()
    cancel_marker = kv.watch_prefix(p + "marker", marker)
    kv.put(p + "marker", b"m", T)
    assert backend.eventually(lambda: len(marker.seen()) == 1, within=5.0)
    cancel_marker()
    assert seen.seen() == [("put", p + "once/a", b"1")]
    cancels[0]()  # cancelling again is harmless


def test_a_failing_callback_does_not_end_the_watch(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    kv, p = backend.kv, backend.prefix
    seen = Recorder()

    def flaky(event: WatchEvent) -> None:
        seen(event)
        if event.value == b"boom":
            raise RuntimeError("callback bug")

    cancel = kv.watch_prefix(p, flaky)
    kv.put(p + "x", b"boom", T)
    kv.put(p + "y", b"fine", T)
    assert backend.eventually(lambda: len(seen.seen()) == 2, within=5.0)
    cancel()
    assert "callback bug" in caplog.text


def test_bad_arguments_are_config_errors(backend: Backend) -> None:
    kv, p = backend.kv, backend.prefix
    with pytest.raises(ConfigError, match="timeout=0"):
        kv.get(p + "x", 0)
    with pytest.raises(ConfigError, match="ttl=-1"):
        kv.grant_lease(-1, T)
    lease = kv.grant_lease(1, T)
    with pytest.raises(ConfigError, match="below the lease TTL"):
        kv.keepalive(lease, 1.0)
    with pytest.raises(ConfigError, match="start_revision=0"):
        kv.watch_prefix(p, lambda e: None, start_revision=0)
    lease.revoke()


def test_closed_store_refuses_calls(backend: Backend) -> None:
    backend.kv.close()
    with pytest.raises(KVError, match="closed"):
        backend.kv.get(backend.prefix + "x", T)


# --------------------------------------------------------------------------- MemoryKV only


def test_memory_lease_expires_exactly_at_its_ttl_on_the_clock() -> None:
    clock = FakeClock()
    kv = MemoryKV(now=clock)
    lease = kv.grant_lease(2, T)
    kv.put("/k", b"v", T, lease=lease)
    clock.t += 1.999
    assert kv.expire_leases() == []
    lease.refresh()  # deadline is now t + 2
    clock.t += 1.999
    assert kv.get("/k", T) is not None
    clock.t += 0.001
    assert kv.get("/k", T) is None  # any call expires what is due, not only expire_leases


def test_memory_keepalive_stop_counts_the_ttl_from_the_stop() -> None:
    clock = FakeClock()
    kv = MemoryKV(now=clock)
    lease = kv.grant_lease(1, T)
    kv.put("/k", b"v", T, lease=lease)
    stop = kv.keepalive(lease, 0.5)
    clock.t += 100.0
    assert kv.expire_leases() == []
    stop()
    clock.t += 0.999
    assert kv.expire_leases() == []
    clock.t += 0.001
    assert kv.expire_leases() == [lease.id]


def test_memory_cut_off_client_loses_its_lease_and_its_watch_catches_up() -> None:
    clock = FakeClock()
    store = MemoryKV(now=clock)
    node, observer = store.client(), store.client()
    lease = node.grant_lease(1, T)
    node.put("/nodes/a", b"a", T, lease=lease)
    node.keepalive(lease, 0.25)
    seen = Recorder()
    node.watch_prefix("/nodes/", seen)
    node.set_unavailable(True)
    with pytest.raises(KVError, match="cut off"):
        node.get("/nodes/a", T)
    observer.put("/nodes/b", b"b", T)
    clock.t += 1.0
    assert observer.get("/nodes/a", T) is None  # its keepalive could not reach the store
    assert seen.seen() == []  # nothing reaches a client that is cut off
    node.set_unavailable(False)
    assert seen.seen() == [("put", "/nodes/b", b"b"), ("delete", "/nodes/a", None)]
    observer.put("/nodes/c", b"c", T)
    assert seen.seen()[-1] == ("put", "/nodes/c", b"c")
    node.close()
    assert observer.get("/nodes/c", T) is not None  # closing one client leaves the others


def test_memory_writes_from_callbacks_keep_revision_order() -> None:
    kv = MemoryKV()
    first, second = Recorder(), Recorder()

    def echo(event: WatchEvent) -> None:
        first(event)
        if event.key == "/a":
            kv.put("/b", b"from callback", T)

    kv.watch_prefix("/", echo)
    kv.watch_prefix("/", second)
    kv.put("/a", b"1", T)
    want = [("put", "/a", b"1"), ("put", "/b", b"from callback")]
    assert first.seen() == want  # delivered before put() returned
    assert second.seen() == want
    assert [e.revision for e in second.events] == [2, 3]


def test_memory_is_thread_safe_and_revisions_are_unique() -> None:
    kv = MemoryKV()
    seen = Recorder()
    kv.watch_prefix("/", seen)
    revisions: list[int] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        for j in range(50):
            r = kv.put(f"/w{i}/{j}", b"x", T)
            with lock:
                revisions.append(r)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert sorted(revisions) == list(range(2, 202))
    assert [e.revision for e in seen.events] == list(range(2, 202))
