"""The key-value store the node agent coordinates through: the interface and its errors.

Where it sits: membership, the commit protocol and the operator's status reader see etcd
only through `KVStore`. `keepstep.agent.kv.etcd.EtcdKV` is the one implementation that talks
to a server; `keepstep.agent.kv.memory.MemoryKV` is the fake that unit tests use instead
(also importable from here). Both keep etcd's semantics: one revision counter for the whole
keyspace, whole-second lease TTLs, keys removed when their lease expires, and watch events
delivered in revision order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from keepstep.errors import ConfigError, KeepstepError

if TYPE_CHECKING:
    from keepstep.agent.kv.memory import MemoryKV as MemoryKV
    from keepstep.agent.kv.memory import MemoryLease as MemoryLease

log = logging.getLogger(__name__)

T = TypeVar("T")


class KVError(KeepstepError):
    """The store refused a call or could not be reached; the call's outcome may be unknown."""


class KVTimeout(KVError):
    """The store did not answer within the call's timeout."""


class KVUnavailable(KVError):
    """The store could not serve the call now (no leader while it elects one, the member
    reached is gone); like a timeout, the call may have been applied."""


class LeaseLost(KVError):
    """The lease has expired or was revoked: the keys put with it are gone."""


class KVDenied(KVError):
    """The store refused the call: the client's identity may not touch that key."""


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    mod_revision: int
    lease: int | None

    def __post_init__(self) -> None:
        if self.mod_revision < 1:
            raise ConfigError(f"mod_revision={self.mod_revision} of {self.key!r} must be >= 1")


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes | None  # None exactly for deletes
    revision: int

    def __post_init__(self) -> None:
        if self.kind not in ("put", "delete"):
            raise ConfigError(f"watch event kind={self.kind!r} must be 'put' or 'delete'")
        if (self.value is None) != (self.kind == "delete"):
            raise ConfigError(f"a {self.kind} event of {self.key!r} has value={self.value!r}")


class Lease(Protocol):
    """A granted lease; keys put with it are deleted when it expires or is revoked."""

    @property
    def id(self) -> int: ...
    @property
    def ttl(self) -> float: ...  # as granted: whole seconds, at least 1
    def refresh(self) -> None: ...  # LeaseLost if it has already expired
    def revoke(self) -> None: ...  # idempotent


class KVStore(Protocol):
    """What the agent needs from etcd. Every blocking call takes a timeout in seconds and
    raises `KVTimeout` when it runs out, `KVError` when the store fails or is unreachable,
    and `ConfigError` for an argument that can never work. Keys are text, values bytes."""

    def get(self, key: str, timeout: float) -> KV | None: ...

    def get_prefix(self, prefix: str, timeout: float) -> list[KV]:
        """Every key that starts with `prefix`, sorted by key."""
        ...

    def put(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> int:
        """Write unconditionally; returns the revision of the write."""
        ...

    def create(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> bool:
        """Write only if the key does not exist; False (and no write) if it does."""
        ...

    def compare_and_put(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        timeout: float,
        lease: Lease | None = None,
    ) -> bool:
        """Write only if the key's mod_revision is `expected_mod_revision` (0: must not
        exist). A write without `lease` detaches the key from any lease it had."""
        ...

    def delete(self, key: str, timeout: float) -> bool:
        """True if the key existed."""
        ...

    def delete_prefix(self, prefix: str, timeout: float) -> int:
        """Delete every key under `prefix` in one revision; returns how many there were."""
        ...

    def grant_lease(self, ttl: float, timeout: float) -> Lease:
        """A new lease of `lease_seconds(ttl)` (etcd may grant more, never less)."""
        ...

    def keepalive(self, lease: Lease, interval: float) -> Callable[[], None]:
        """Refresh `lease` every `interval` s (below its TTL) until the returned stop()."""
        ...

    def watch_prefix(
        self,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        start_revision: int | None = None,
        below: str | None = None,
    ) -> Callable[[], None]:
        """Call `callback` with every change under `prefix`, in revision order, from
        `start_revision` (None: from now on) until the returned cancel(). When this returns
        the watch is in place: any later write is seen. A callback that raises is logged.
        With `below`, only keys that sort before it (a key range; etcd sends nothing else)."""
        ...

    def close(self) -> None:
        """Cancel this client's watches and keepalives; later calls raise KVError."""
        ...


def check_below(prefix: str, below: str | None) -> None:
    if below is not None and not (below.startswith(prefix) and below > prefix):
        raise ConfigError(f"below={below!r} must be a key under prefix={prefix!r}")


def check_timeout(timeout: float) -> float:
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"timeout={timeout!r} must be a finite number of seconds > 0")
    return float(timeout)


def lease_seconds(ttl: float) -> int:
    """The TTL etcd grants for a requested one: whole seconds, rounded up, at least 1."""
    if not (isinstance(ttl, int | float) and math.isfinite(ttl) and ttl > 0):
        raise ConfigError(f"lease ttl={ttl!r} must be a finite number of seconds > 0")
    return max(1, math.ceil(ttl))


def check_keepalive(lease: Lease, interval: float) -> float:
    if not (isinstance(interval, int | float) and 0 < interval < lease.ttl):
        raise ConfigError(
            f"keepalive interval={interval!r} must be > 0 and below the lease TTL {lease.ttl} s"
        )
    return float(interval)


def check_start_revision(start_revision: int | None) -> None:
    if start_revision is not None and (not isinstance(start_revision, int) or start_revision < 1):
        raise ConfigError(f"start_revision={start_revision!r} must be None or an integer >= 1")


def patiently(what: str, call: Callable[[], T], within_s: float, pause_s: float = 0.2) -> T:
    """`call`, asked again while the store does not answer (KVTimeout, KVUnavailable), for
    at most `within_s` seconds in all; then its last error. etcd electing a leader (its
    leader lost) answers nothing, or UNAVAILABLE, for seconds. Only for calls that may be
    asked twice: a call that timed out may have been applied."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except (KVTimeout, KVUnavailable) as error:
            if time.monotonic() >= deadline:
                raise
            log.warning("%s: %s; asking again", what, error)
            time.sleep(pause_s)


def __getattr__(name: str) -> object:
    # The fake imports this module, so importing it at the top would be a cycle; its names
    # are re-exported on first use instead.
    if name in ("MemoryKV", "MemoryLease"):
        from keepstep.agent.kv import memory as kv_memory

        return getattr(kv_memory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
