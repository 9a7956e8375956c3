"""`EtcdKV`: the agent's `KVStore` over a real etcd.

Where it sits: membership, the commit protocol and the operator's status reader get a
`KVStore`; on a cluster (and in integration tests) it is this class, pointed at the job's
etcd. This module and `etcd_watch` (its watch streams) are the only ones that talk to etcd.
It uses pyetcd's generated gRPC stubs directly rather than pyetcd's client methods, for three
reasons: those methods apply one client-wide timeout (every call here has its own deadline);
after one UNAVAILABLE answer pyetcd marks its only endpoint failed and refuses every call for
five minutes; and pyetcd's watcher cannot end its stream (etcd keeps a watch stream open after
the client half-closes it), so a cancelled watch would leave a thread behind. gRPC errors
become `KVTimeout` (deadline), `LeaseLost` (the lease is gone) or `KVError` (anything else);
calls on a dead server fail fast instead of hanging.

Watches: each `watch_prefix` owns one gRPC stream and one thread that runs the callback,
in revision order (see `etcd_watch`). Keepalives: one thread per lease, refreshing every
`interval` seconds; a failed refresh is retried at the next beat, a lost lease ends the
thread with a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd.utils import prefix_range_end

from keepstep.agent.etcd_watch import EtcdWatch, rpc_error
from keepstep.agent.kv import (
    KV,
    KVError,
    Lease,
    LeaseLost,
    WatchEvent,
    check_keepalive,
    check_start_revision,
    check_timeout,
    lease_seconds,
)
from keepstep.errors import ConfigError

log = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead peer under an open watch. etcd refuses pings closer than 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split "host:port" (an "http://" in front is accepted) into (host, port)."""
    text = endpoint.removeprefix("http://").rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {endpoint!r} must look like 127.0.0.1:2379")
    return host, int(port)


def _kv(raw: Any) -> KV:
    return KV(
        raw.key.decode(errors="surrogateescape"), raw.value, raw.mod_revision, raw.lease or None
    )


def _range(prefix: str) -> tuple[bytes, bytes]:
    key = prefix.encode()
    return (key, prefix_range_end(key)) if key else (b"\0", b"\0")  # "": the whole keyspace


class EtcdLease:
    """A lease granted by etcd; `ttl` is what etcd granted (whole seconds)."""

    def __init__(self, lease_id: int, ttl: float, kv: EtcdKV) -> None:
        self.id = lease_id
        self.ttl = ttl
        self._kv = kv

    def refresh(self, timeout: float | None = None) -> None:
        self._kv._refresh(self.id, self._kv.timeout if timeout is None else timeout)

    def revoke(self, timeout: float | None = None) -> None:
        request = etcdrpc.LeaseRevokeRequest(ID=self.id)
        try:
            what = f"revoke lease {self.id:x}"
            self._kv._unary(what, self._kv._leases.LeaseRevoke, request, timeout)
        except LeaseLost:
            pass  # already gone: revoking is idempotent

    def __repr__(self) -> str:
        return f"EtcdLease(id={self.id:x}, ttl={self.ttl})"


class EtcdKV:
    """A `KVStore` on the etcd at `endpoint`; `timeout` is the default for calls without one."""

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint = f"{host}:{port}"
        self.timeout = check_timeout(timeout)
        self._channel = grpc.insecure_channel(self.endpoint, options=_GRPC_OPTIONS)
        self._kvs = etcdrpc.KVStub(self._channel)
        self._leases = etcdrpc.LeaseStub(self._channel)
        self._watch_stub = etcdrpc.WatchStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        self._stoppers: set[Callable[[], None]] = set()  # open watches and keepalives

    # ------------------------------------------------------------------ reads and writes

    def get(self, key: str, timeout: float) -> KV | None:
        request = etcdrpc.RangeRequest(key=key.encode())
        response = self._unary(f"get {key!r}", self._kvs.Range, request, timeout)
        return _kv(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str, timeout: float) -> list[KV]:
        key, end = _range(prefix)
        request = etcdrpc.RangeRequest(
            key=key,
            range_end=end,
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        response = self._unary(f"get prefix {prefix!r}", self._kvs.Range, request, timeout)
        return [_kv(raw) for raw in response.kvs]

    def put(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> int:
        request = _put_request(key, value, lease)
        response = self._unary(f"put {key!r}", self._kvs.Put, request, timeout)
        return int(response.header.revision)

    def create(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> bool:
        compare = etcdrpc.Compare(
            key=key.encode(),
            target=etcdrpc.Compare.CREATE,
            result=etcdrpc.Compare.EQUAL,
            create_revision=0,
        )
        return self._txn(f"create {key!r}", compare, _put_request(key, value, lease), timeout)

    def compare_and_put(
        self,
        key: str,
        value: bytes,
        expected_mod_revision: int,
        timeout: float,
        lease: Lease | None = None,
    ) -> bool:
        # etcd compares a missing key as mod_revision 0, so 0 means "must not exist".
        compare = etcdrpc.Compare(
            key=key.encode(),
            target=etcdrpc.Compare.MOD,
            result=etcdrpc.Compare.EQUAL,
            mod_revision=expected_mod_revision,
        )
        what = f"compare-and-put {key!r} at mod_revision {expected_mod_revision}"
        return self._txn(what, compare, _put_request(key, value, lease), timeout)

    def delete(self, key: str, timeout: float) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        response = self._unary(f"delete {key!r}", self._kvs.DeleteRange, request, timeout)
        return int(response.deleted) > 0

    def delete_prefix(self, prefix: str, timeout: float) -> int:
        key, end = _range(prefix)
        request = etcdrpc.DeleteRangeRequest(key=key, range_end=end)
        response = self._unary(f"delete prefix {prefix!r}", self._kvs.DeleteRange, request, timeout)
        return int(response.deleted)

    # ------------------------------------------------------------------ leases

    def grant_lease(self, ttl: float, timeout: float) -> EtcdLease:
        request = etcdrpc.LeaseGrantRequest(TTL=lease_seconds(ttl), ID=0)
        response = self._unary(f"grant lease of {ttl} s", self._leases.LeaseGrant, request, timeout)
        if response.error:
            raise KVError(f"grant lease of {ttl} s: etcd refused: {response.error}")
        return EtcdLease(int(response.ID), float(response.TTL), self)

    def keepalive(self, lease: Lease, interval: float) -> Callable[[], None]:
        check_keepalive(lease, interval)
        stop_event = threading.Event()
        # A refresh that takes longer than the TTL is too late to matter.
        refresh_timeout = min(self.timeout, lease.ttl)

        def beat() -> None:
            while not stop_event.wait(interval):
                try:
                    self._refresh(lease.id, refresh_timeout)
                except LeaseLost:
                    if not stop_event.is_set():
                        log.warning("lease %x expired before its keepalive stopped", lease.id)
                    return
                except KVError as err:
                    if not stop_event.is_set():
                        log.info("keepalive of lease %x failed, retrying: %s", lease.id, err)

        thread = threading.Thread(target=beat, name=f"keepstep-keepalive-{lease.id:x}", daemon=True)

        def stop() -> None:
            stop_event.set()
            with self._lock:
                self._stoppers.discard(stop)
            if thread is not threading.current_thread():
                thread.join(refresh_timeout + 1.0)

        with self._lock:
            self._check_open()
            self._stoppers.add(stop)
        thread.start()
        return stop

    def _refresh(self, lease_id: int, timeout: float) -> None:
        what = f"refresh lease {lease_id:x}"
        self._check_open()
        check_timeout(timeout)
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        call = self._leases.LeaseKeepAlive(iter([request]), timeout=timeout)
        try:
            for response in call:
                if response.TTL <= 0:  # etcd's answer for a lease it no longer has
                    raise LeaseLost(f"{what}: the lease has expired or was revoked")
                return
        except grpc.RpcError as err:
            raise rpc_error(what, err, timeout) from err
        finally:
            call.cancel()
        raise KVError(f"{what}: etcd closed the keepalive stream without an answer")

    # ------------------------------------------------------------------ watches

    def watch_prefix(
        self,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        start_revision: int | None = None,
    ) -> Callable[[], None]:
        check_start_revision(start_revision)
        key, end = _range(prefix)
        watch = EtcdWatch(self._watch_stub, prefix, key, end, callback, start_revision)

        def cancel() -> None:
            watch.cancel()
            with self._lock:
                self._stoppers.discard(cancel)

        with self._lock:
            self._check_open()
            self._stoppers.add(cancel)
        try:
            watch.start(self.timeout)
        except BaseException:
            cancel()
            raise
        return cancel

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stoppers = list(self._stoppers)
        for stop in stoppers:
            stop()
        self._channel.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise KVError(f"the EtcdKV client of {self.endpoint} is closed")

    def _unary(self, what: str, method: Any, request: Any, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        self._check_open()
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as err:
            raise rpc_error(what, err, timeout) from err

    def _txn(self, what: str, compare: Any, put: Any, timeout: float) -> bool:
        request = etcdrpc.TxnRequest(
            compare=[compare], success=[etcdrpc.RequestOp(request_put=put)], failure=[]
        )
        return bool(self._unary(what, self._kvs.Txn, request, timeout).succeeded)


def _put_request(key: str, value: bytes, lease: Lease | None) -> Any:
    return etcdrpc.PutRequest(
        key=key.encode(), value=bytes(value), lease=0 if lease is None else lease.id
    )
