"""`EtcdKV`: the agent's `KVStore` over a real etcd.

Where it sits: membership, the commit protocol and the operator's status reader get a
`KVStore`; on a cluster (and in integration tests) it is this class, pointed at the job's
etcd. This module and `etcd_watch` (its watch streams) are the only ones that talk to etcd.
It uses only pyetcd's generated gRPC stubs (`pyetcd.etcdrpc`, from etcd's v3 .proto files),
not pyetcd's client methods, for three reasons: those methods apply one client-wide timeout
(every call here has its own deadline); after one UNAVAILABLE answer pyetcd marks its only
endpoint failed and refuses every call for five minutes; and pyetcd's watcher cannot end
its stream (etcd keeps a watch stream open after the client half-closes it), so a
cancelled watch would leave a thread behind. gRPC errors become `KVTimeout` (deadline),
`LeaseLost` (the lease is gone) or `KVError` (anything else); a call to a dead server
fails instead of hanging: at once, or, for a read that is retried, once its deadline
passed without a member answering. Every call and field used here is in etcd's v3 API by
3.3; the lowest server version keepstep starts is in `keepstep.launch.etcd_binary`.

Several members: `endpoint` may list them ("h:p1,h:p2,h:p3", IP addresses; or one DNS
name whose answer holds several). One gRPC channel spans them all with round-robin
balancing, so calls and streams are spread over the members and a member that dies is
left out as soon as its connection breaks: a call in flight on it fails (reads and lease
revokes, which are safe to repeat, are retried on another member within their deadline;
writes are not, since a write that failed may still have been applied), a failed lease
refresh is tried again at once rather than a beat later, and its watch streams are reopened
on another member from the next revision.

Watches: each `watch_prefix` owns one gRPC stream and one thread that runs the callback,
in revision order (see `etcd_watch`). Keepalives: one thread per lease, refreshing every
`interval` seconds over one long-lived stream (`etcd_keepalive`); a failed refresh is
retried at once and then at the next beat, a lost lease ends the thread with a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from pyetcd import etcdrpc

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
from keepstep.agent.kv.etcd_channel import (
    EtcdCredentials,
    open_channel,
    parse_endpoint,
    parse_endpoints,
)
from keepstep.agent.kv.etcd_keepalive import KeepAliveStream, lease_answer
from keepstep.agent.kv.etcd_watch import EtcdWatch, rpc_error

__all__ = ["EtcdCredentials", "EtcdKV", "EtcdLease", "parse_endpoint", "parse_endpoints"]

log = logging.getLogger(__name__)

_RETRY_PAUSE_S = 0.02  # between a read that met a dead member and its retry on another


def _kv(raw: Any) -> KV:
    return KV(
        raw.key.decode(errors="surrogateescape"), raw.value, raw.mod_revision, raw.lease or None
    )


def _range(prefix: str) -> tuple[bytes, bytes]:
    key = prefix.encode()
    return (key, range_end(key)) if key else (b"\0", b"\0")  # "": the whole keyspace


def range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end of a
    prefix): the prefix with its last byte below 0xff incremented and what follows dropped;
    b"\0" (to the end of the keyspace) if every byte is 0xff."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


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
            self._kv._unary(what, self._kv._leases.LeaseRevoke, request, timeout, retry=True)
        except LeaseLost:
            pass  # already gone: revoking is idempotent

    def __repr__(self) -> str:
        return f"EtcdLease(id={self.id:x}, ttl={self.ttl})"


class EtcdKV:
    """A `KVStore` on the etcd at `endpoint` ("host:port", or several, comma-separated:
    the members of one cluster); `timeout` is the default for calls without one.
    With `credentials` it speaks TLS and acts as the user its client certificate names."""

    def __init__(
        self, endpoint: str, timeout: float = 5.0, credentials: EtcdCredentials | None = None
    ) -> None:
        addresses = parse_endpoints(endpoint)
        self.endpoint = ",".join(f"{host}:{port}" for host, port in addresses)
        self.timeout = check_timeout(timeout)
        self.secure = credentials is not None
        self._channel = open_channel(addresses, credentials)
        self._kvs = etcdrpc.KVStub(self._channel)
        self._leases = etcdrpc.LeaseStub(self._channel)
        self._watch_stub = etcdrpc.WatchStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        self._stoppers: set[Callable[[], None]] = set()  # open watches and keepalives

    # ------------------------------------------------------------------ reads and writes

    def get(self, key: str, timeout: float) -> KV | None:
        request = etcdrpc.RangeRequest(key=key.encode())
        response = self._unary(f"get {key!r}", self._kvs.Range, request, timeout, retry=True)
        return _kv(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str, timeout: float) -> list[KV]:
        key, end = _range(prefix)
        request = etcdrpc.RangeRequest(
            key=key,
            range_end=end,
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        what = f"get prefix {prefix!r}"
        response = self._unary(what, self._kvs.Range, request, timeout, retry=True)
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

        stream = KeepAliveStream(self._leases, lease.id)

        def beat() -> None:
            wait, retried = interval, False
            while not stop_event.wait(wait):
                try:
                    stream.refresh(refresh_timeout)
                    wait, retried = interval, False
                except LeaseLost:
                    if not stop_event.is_set():
                        log.warning("lease %x expired before its keepalive stopped", lease.id)
                    return
                except KVError as err:
                    if not stop_event.is_set():
                        log.info("keepalive of lease %x failed, retrying: %s", lease.id, err)
                    # Once at once (another member may answer), then at the usual beat.
                    wait, retried = (interval, False) if retried else (_RETRY_PAUSE_S, True)

        thread = threading.Thread(target=beat, name=f"keepstep-keepalive-{lease.id:x}", daemon=True)

        def stop() -> None:
            stop_event.set()
            stream.close()
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
                lost = lease_answer(what, response)
                if lost is not None:
                    raise lost
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
        below: str | None = None,
    ) -> Callable[[], None]:
        check_start_revision(start_revision)
        check_below(prefix, below)
        key, end = _range(prefix)
        if below is not None:
            end = below.encode()
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

    def __enter__(self) -> EtcdKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def call(
        self, what: str, method: Any, request: Any, timeout: float | None, retry: bool = False
    ) -> Any:
        """One call of another etcd service on this client's channel (`etcd_auth` uses
        it), with the deadline, retry and error mapping of this class's own calls."""
        return self._unary(what, method, request, timeout, retry)

    def channel(self) -> grpc.Channel:
        """The gRPC channel, for stubs of etcd's other services (Auth, Cluster)."""
        self._check_open()
        return self._channel

    def _check_open(self) -> None:
        if self._closed:
            raise KVError(f"the EtcdKV client of {self.endpoint} is closed")

    def _unary(
        self, what: str, method: Any, request: Any, timeout: float | None, retry: bool = False
    ) -> Any:
        """One call under one deadline; `retry`: a call safe to repeat is tried again on
        another member when the one it reached is unavailable, until the deadline."""
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        self._check_open()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return method(request, timeout=max(left, 0.001))
            except grpc.RpcError as err:
                again = retry and err.code() == grpc.StatusCode.UNAVAILABLE
                if not again or deadline - time.monotonic() <= _RETRY_PAUSE_S or self._closed:
                    raise rpc_error(what, err, timeout) from err
            time.sleep(_RETRY_PAUSE_S)

    def _txn(self, what: str, compare: Any, put: Any, timeout: float) -> bool:
        request = etcdrpc.TxnRequest(
            compare=[compare], success=[etcdrpc.RequestOp(request_put=put)], failure=[]
        )
        return bool(self._unary(what, self._kvs.Txn, request, timeout).succeeded)


def _put_request(key: str, value: bytes, lease: Lease | None) -> Any:
    return etcdrpc.PutRequest(
        key=key.encode(), value=bytes(value), lease=0 if lease is None else lease.id
    )
