"""`MemoryKV`: an in-memory `KVStore` with etcd's semantics, the fake beside `EtcdKV`.

Where it sits: unit tests of membership, the commit protocol and the operator's status reader
hand it to the code under test instead of `keepstep.agent.kv.etcd.EtcdKV`; the interface it
implements and the errors it raises are in `keepstep.agent.kv`.

`MemoryKV` in short:
- time comes from an injected clock (`now`); nothing runs in the background. A lease whose
  deadline has passed is expired at the start of the next call or by `expire_leases()`.
- a lease under `keepalive` never expires while the client that keeps it alive is
  available; `stop()` refreshes it one last time, as a real keepalive's last beat would.
- watch callbacks run synchronously in the writing thread: when `put`/`delete` returns,
  every watcher has seen the event. A write made from inside a callback is delivered
  right after that callback returns, still in revision order.
- `client()` opens a second client of the same store and `set_unavailable()` cuts one
  client off: its calls raise `KVError`, its keepalives stop (so its leases expire), and
  its watches resume from where they stopped when it comes back, as etcd watches do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from keepstep.agent.kv import (
    KV,
    KVError,
    Lease,
    LeaseLost,
    WatchEvent,
    check_below,
    check_keepalive,
    check_start_revision,
    check_timeout,
    lease_seconds,
)

__all__ = ["MemoryKV", "MemoryLease"]

# The logger of the module the fake came from, so logging set up for it still applies.
log = logging.getLogger("keepstep.agent.kv")


@dataclass
class _Entry:
    value: bytes
    mod_revision: int
    lease: int | None


@dataclass
class _LeaseState:
    ttl: int
    deadline: float
    keys: set[str] = field(default_factory=set)
    keepers: set[MemoryKV] = field(default_factory=set)  # clients running keepalive on it


@dataclass(eq=False)
class _Watch:
    owner: MemoryKV
    prefix: str
    callback: Callable[[WatchEvent], None]
    min_revision: int
    next_index: int  # the first history entry this watch has not been given
    below: str | None = None
    cancelled: bool = False

    def covers(self, key: str) -> bool:
        return key.startswith(self.prefix) and (self.below is None or key < self.below)


class _Store:
    """The state that all clients of one MemoryKV share; every method needs `cond` held."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.cond = threading.Condition(threading.RLock())
        self.revision = 1  # as in etcd, an empty store is at revision 1
        self.data: dict[str, _Entry] = {}
        self.leases: dict[int, _LeaseState] = {}
        self.next_lease = 0x5EED0001
        self.history: list[WatchEvent] = []
        self.watches: list[_Watch] = []
        self.queue: deque[tuple[int, tuple[_Watch, ...]]] = deque()  # (history index, targets)
        self.drainer: threading.Thread | None = None

    def settle(self) -> list[int]:
        """Refresh kept-alive leases and expire the overdue ones; returns the expired ids."""
        now = self.now()
        expired = []
        for lease_id, state in list(self.leases.items()):
            if any(keeper._live() for keeper in state.keepers):
                state.deadline = now + state.ttl
            elif state.deadline <= now:
                del self.leases[lease_id]
                self.remove(sorted(state.keys))
                expired.append(lease_id)
        return expired

    def write(self, key: str, value: bytes, lease: Lease | None) -> int:
        if lease is not None and lease.id not in self.leases:
            raise LeaseLost(f"put {key!r}: lease {lease.id:x} has expired or was revoked")
        old = self.data.get(key)
        if old is not None and old.lease is not None and old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        self.revision += 1
        lease_id = None if lease is None else lease.id
        self.data[key] = _Entry(bytes(value), self.revision, lease_id)
        if lease_id is not None:
            self.leases[lease_id].keys.add(key)
        self.publish(WatchEvent("put", key, bytes(value), self.revision))
        return self.revision

    def remove(self, keys: list[str]) -> int:
        if not keys:
            return 0
        self.revision += 1  # one revision for the whole range, as etcd's DeleteRange
        for key in keys:
            entry = self.data.pop(key)
            if entry.lease is not None and entry.lease in self.leases:
                self.leases[entry.lease].keys.discard(key)
            self.publish(WatchEvent("delete", key, None, self.revision))
        return len(keys)

    def publish(self, event: WatchEvent) -> None:
        self.history.append(event)
        targets = tuple(w for w in self.watches if w.covers(event.key))
        if targets:
            self.queue.append((len(self.history) - 1, targets))

    def replay(self, watch: _Watch) -> None:
        # Ahead of anything queued: a watch must see older events first. Queued copies of
        # the same events are then skipped by the next_index check in deliver().
        for index in range(len(self.history) - 1, watch.next_index - 1, -1):
            if watch.covers(self.history[index].key):
                self.queue.appendleft((index, (watch,)))

    def deliver(self, timeout: float) -> None:
        """Run queued callbacks in this thread, unless another thread already does.

        Called without `cond` held, after a write: waits (up to `timeout`) for another
        thread's delivery to finish, so that a write returns after its events were seen.
        """
        me = threading.current_thread()
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if self.drainer is me:
                    return  # a write from inside a callback: the running loop delivers it
                if self.drainer is None:
                    if not self.queue:
                        return
                    self.drainer = me
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return  # the other thread's loop still delivers our events
                self.cond.wait(remaining)
        try:
            while True:
                with self.cond:
                    if not self.queue:
                        return
                    index, targets = self.queue.popleft()
                    event = self.history[index]
                    due = []
                    for w in targets:
                        if not w.cancelled and w.owner._live() and index >= w.next_index:
                            w.next_index = index + 1
                            if event.revision >= w.min_revision:
                                due.append(w)
                for w in due:
                    try:
                        w.callback(event)
                    except Exception:
                        log.exception("watch callback for prefix %r failed on %s", w.prefix, event)
        finally:
            with self.cond:
                self.drainer = None
                self.cond.notify_all()


@dataclass(frozen=True)
class MemoryLease:
    id: int
    ttl: float
    _kv: MemoryKV = field(repr=False, compare=False)

    def refresh(self) -> None:
        with self._kv._call(1.0) as s:
            state = s.leases.get(self.id)
            if state is None:
                raise LeaseLost(f"lease {self.id:x} has expired or was revoked")
            state.deadline = s.now() + state.ttl

    def revoke(self) -> None:
        with self._kv._call(1.0) as s:
            state = s.leases.pop(self.id, None)
            if state is not None:
                s.remove(sorted(state.keys))


class MemoryKV:
    """A thread-safe in-memory KVStore with etcd's semantics; see the module docstring."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._attach(_Store(now))

    def _attach(self, store: _Store) -> None:
        self._store = store
        self._closed = False
        self._unavailable = False
        self._keepalives: set[int] = set()

    def client(self) -> MemoryKV:
        """Another client of the same store, with its own watches, keepalives and availability."""
        other = MemoryKV.__new__(MemoryKV)
        other._attach(self._store)
        return other

    def get(self, key: str, timeout: float) -> KV | None:
        with self._call(timeout) as s:
            e = s.data.get(key)
            return None if e is None else KV(key, e.value, e.mod_revision, e.lease)

    def get_prefix(self, prefix: str, timeout: float) -> list[KV]:
        with self._call(timeout) as s:
            return [
                KV(k, e.value, e.mod_revision, e.lease)
                for k, e in sorted(s.data.items())
                if k.startswith(prefix)
            ]

    def put(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> int:
        with self._call(timeout) as s:
            return s.write(key, value, lease)

    def create(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> bool:
        return self.compare_and_put(key, value, 0, timeout, lease)

    def compare_and_put(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        timeout: float,
        lease: Lease | None = None,
    ) -> bool:
        with self._call(timeout) as s:
            entry = s.data.get(key)
            if (0 if entry is None else entry.mod_revision) != expected_mod_revision:
                return False
            s.write(key, value, lease)
            return True

    def delete(self, key: str, timeout: float) -> bool:
        with self._call(timeout) as s:
            return s.remove([key] if key in s.data else []) > 0

    def delete_prefix(self, prefix: str, timeout: float) -> int:
        with self._call(timeout) as s:
            return s.remove(sorted(k for k in s.data if k.startswith(prefix)))

    def grant_lease(self, ttl: float, timeout: float) -> MemoryLease:
        seconds = lease_seconds(ttl)
        with self._call(timeout) as s:
            lease_id = s.next_lease
            s.next_lease += 1
            s.leases[lease_id] = _LeaseState(seconds, s.now() + seconds)
        return MemoryLease(lease_id, float(seconds), self)

    def keepalive(self, lease: Lease, interval: float) -> Callable[[], None]:
        check_keepalive(lease, interval)
        with self._call(1.0) as s:
            if lease.id not in s.leases:
                raise LeaseLost(f"lease {lease.id:x} has expired or was revoked")
            s.leases[lease.id].keepers.add(self)
            self._keepalives.add(lease.id)
        stopped = False

        def stop() -> None:
            nonlocal stopped
            with s.cond:
                if stopped:
                    return
                stopped = True
                self._keepalives.discard(lease.id)
                state = s.leases.get(lease.id)
                if state is not None and self in state.keepers:
                    state.keepers.discard(self)
                    if self._live():
                        state.deadline = s.now() + state.ttl

        return stop

    def expire_leases(self) -> list[int]:
        """Expire every lease whose deadline has passed on the clock; returns their ids."""
        with self._store.cond:
            expired = self._store.settle()
        self._store.deliver(10.0)
        return expired

    def watch_prefix(
        self,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        start_revision: int | None = None,
        below: str | None = None,
    ) -> Callable[[], None]:
        check_start_revision(start_revision)
        check_below(prefix, below)
        with self._call(1.0) as s:
            start = len(s.history)
            if start_revision is not None:
                while start > 0 and s.history[start - 1].revision >= start_revision:
                    start -= 1
            watch = _Watch(self, prefix, callback, start_revision or 0, start, below)
            s.watches.append(watch)
            s.replay(watch)

        def cancel() -> None:
            with s.cond:
                watch.cancelled = True
                if watch in s.watches:
                    s.watches.remove(watch)

        return cancel

    def set_unavailable(self, unavailable: bool) -> None:
        """Cut this client off from the store (True) or reconnect it (False)."""
        s = self._store
        with s.cond:
            s.settle()  # this client's keepalives beat up to the moment of the cut
            self._unavailable = unavailable
            if not unavailable:
                for watch in s.watches:
                    if watch.owner is self:
                        s.replay(watch)
        s.deliver(10.0)

    def close(self) -> None:
        s = self._store
        with s.cond:
            self._closed = True
            for watch in [w for w in s.watches if w.owner is self]:
                watch.cancelled = True
                s.watches.remove(watch)
            for lease_id in self._keepalives:
                if lease_id in s.leases:
                    s.leases[lease_id].keepers.discard(self)
            self._keepalives.clear()

    def _live(self) -> bool:
        return not (self._closed or self._unavailable)

    @contextmanager
    def _call(self, timeout: float) -> Iterator[_Store]:
        """Hold the store's lock for one call, expiring due leases first; then run callbacks."""
        check_timeout(timeout)
        if self._closed:
            raise KVError("this MemoryKV client is closed")
        if self._unavailable:
            raise KVError("this MemoryKV client is cut off from the store (set_unavailable)")
        try:
            with self._store.cond:
                self._store.settle()
                yield self._store
        finally:
            self._store.deliver(timeout)
