"""This node's presence in etcd: a leased record that disappears when the node goes quiet.

The lease is the hang detector: a stopped or cut-off agent stops refreshing it, etcd
deletes the record within about the lease's TTL, and the other agents' watches see it.
A node that comes back registers again under a new lease.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore, Lease

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

    def register(self) -> None:
        self.lease = self.kv.grant_lease(self.ttl, self.timeout)
        self._stop = self.kv.keepalive(self.lease, self.ttl / 4)
        self.publish()

    def publish(self) -> None:
        """Write the node record again (its worker pids changed)."""
        self.kv.put(self.key, protocol.encode(self.record()), self.timeout, lease=self.lease)

    def renew(self) -> None:
        """The lease expired (the node was stopped or cut off): register as new."""
        self.stop()
        try:
            self.register()
        except KVError as error:
            log.error("could not register again after losing the lease: %s", error)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
