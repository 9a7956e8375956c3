"""This node's presence in etcd: a leased record that disappears when the node goes quiet.

The lease is the hang detector: a stopped or cut-off agent stops refreshing it, etcd
deletes the record within about the lease's TTL, and the other agents' watches see it.
A node that comes back registers again under a new lease.

Two paths notice the expiry when a stopped node is continued, in either order: the
agent's watch sees its own record deleted, and a write under the lease (a worker asking
to be admitted again) is refused. Both ask `renew`, which registers again only while the
lease they saw gone is still the current one, so the second to ask keeps what the first
made (and the records written under it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from keepstep.agent import protocol
from keepstep.agent.kv import KVStore, Lease, LeaseLost

log = logging.getLogger(__name__)


class Registration:
    def __init__(
        self,
        kv: KVStore,
        key: str,
        ttl: float,
        timeout: float,
        record: Callable[[], protocol.NodeRecord],
    ) -> None:
        self.kv, self.key, self.ttl, self.timeout, self.record = kv, key, ttl, timeout, record
        self.lease: Lease | None = None
        self._stop: Callable[[], None] | None = None
        self._lock = threading.Lock()  # one (re-)registration at a time
        self._closed = False
        self._registered = threading.Event()  # the first registration is done

    def register(self) -> None:
        with self._lock:
            self._register()

    def _register(self) -> None:
        self._stop_keepalive()
        self.lease = self.kv.grant_lease(self.ttl, self.timeout)
        self._stop = self.kv.keepalive(self.lease, self.ttl / 4)
        self._write_record()
        self._registered.set()

    def wait_registered(self, timeout: float) -> bool:
        """Whether the node has registered, waiting at most `timeout` s for it: the agent
        starts its workers before it registers (`NodeAgent.start`)."""
        return self._registered.wait(timeout)

    def _write_record(self) -> None:
        self.kv.put(self.key, protocol.encode(self.record()), self.timeout, lease=self.lease)

    def publish(self) -> None:
        """Write the node record again (its worker pids changed); before the node has
        registered, nothing: its registration writes the record, pids and all."""
        if not self._registered.is_set():
            return
        self.put(self.key, protocol.encode(self.record()))

    def put(self, key: str, value: bytes) -> None:
        """Write `key` under this node's lease, so that it goes when the node does. A lease
        that expired while the node was stopped is renewed first and the write made again."""
        lease = self.lease
        try:
            self.kv.put(key, value, self.timeout, lease=lease)
        except LeaseLost:
            log.info("lease expired before writing %r: registering again", key)
            self.renew(lost=lease)
            self.kv.put(key, value, self.timeout, lease=self.lease)

    def renew(self, lost: Lease | None = None) -> None:
        """Register under a new lease if the current one has expired: `lost` is the lease a
        write found gone; without it (the watch saw the record deleted) etcd is asked
        whether the current lease still lives. KVError if etcd cannot be reached."""
        with self._lock:
            current = self.lease
            if self._closed or (lost is not None and current is not lost):
                return  # closing, or renewed since the caller saw it go
            if lost is None and current is not None:
                try:
                    current.refresh()
                except LeaseLost:
                    pass
                else:  # alive: the record deleted was an older lease's, or was removed
                    self._write_record()
                    return
            self._register()

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            self._stop_keepalive()

    def _stop_keepalive(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
