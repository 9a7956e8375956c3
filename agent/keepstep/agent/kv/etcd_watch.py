"""The watch streams of `EtcdKV`: one gRPC stream and one callback thread per watch.

Where it sits: under `keepstep.agent.kv.etcd`, whose `EtcdKV.watch_prefix` makes an `EtcdWatch`
and hands its `cancel` to the caller. Each watch owns one gRPC stream and one thread that runs
the callback, in revision order. When the stream breaks (etcd restarted, connection lost) the
thread reopens it from the revision after the last event it delivered, so nothing is missed
or repeated; over a cluster's channel the new stream goes to a live member, which serves
the same revisions. Each stream asks etcd to require a leader, so a member cut off from
the quorum ends its streams (after a few election timeouts) instead of silently sending
nothing, and the watch moves to a member that is in it. We end the stream ourselves (cancel
the call and close our request iterator) because etcd keeps a watch stream open after the
client half-closes it. `rpc_error`, the mapping of gRPC errors to `KVError`s, is here too
so that `etcd` can import it without a cycle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd.etcdrpc import kv_pb2

from keepstep.agent.kv import KVDenied, KVError, KVTimeout, KVUnavailable, LeaseLost, WatchEvent

__all__ = ["EtcdWatch", "rpc_error"]

# etcd's "require leader" marker (clientv3's WithRequireLeader sends the same).
_REQUIRE_LEADER = (("hasleader", "true"),)
_WARN_AFTER = 3  # streams lost in a row before it is a warning (backoff: ~0.35 s by then)

# The logger of the module this code came from, so logging set up for it still applies.
log = logging.getLogger("keepstep.agent.kv.etcd")


def rpc_error(what: str, err: grpc.RpcError, timeout: float) -> KVError:
    """The KVError that a failed gRPC call raises: KVTimeout, LeaseLost, KVDenied or
    KVError."""
    code, details = err.code(), err.details()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KVTimeout(f"{what}: etcd did not answer within {timeout} s")
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (details or ""):
        return LeaseLost(f"{what}: the lease has expired or was revoked")
    if code == grpc.StatusCode.UNAVAILABLE:
        return KVUnavailable(f"{what}: etcd answered UNAVAILABLE: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return KVDenied(f"{what}: etcd refused it: {details} (these credentials do not cover it)")
    return KVError(f"{what}: etcd answered {code.name}: {details}")


class EtcdWatch:
    """One watch: a gRPC stream, reopened after failures, and the thread that reads it."""

    def __init__(
        self,
        stub: Any,
        prefix: str,
        key: bytes,
        range_end: bytes,
        callback: Callable[[WatchEvent], None],
        start_revision: int | None,
    ) -> None:
        self._stub = stub
        self._prefix = prefix
        self._key = key
        self._range_end = range_end
        self._callback = callback
        self._next_revision = start_revision  # None until etcd says where "now" is
        self._stop = threading.Event()
        self._created = threading.Event()
        self._first_error: KVError | None = None
        self._unreachable: KVError | None = None  # why the last try to open it failed
        self._lock = threading.Lock()
        self._call: Any = None
        self._stream_done: threading.Event | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"keepstep-watch {prefix}", daemon=True
        )

    def start(self, timeout: float) -> None:
        """Return once etcd confirmed the watch: every later write will be seen."""
        self._thread.start()
        if not self._created.wait(timeout):
            if self._unreachable is not None:  # etcd never answered: say why
                raise self._unreachable
            raise KVTimeout(f"watch {self._prefix!r}: etcd did not confirm within {timeout} s")
        if self._first_error is not None:
            raise self._first_error

    def cancel(self) -> None:
        self._stop.set()
        with self._lock:
            call, done = self._call, self._stream_done
        if done is not None:
            done.set()
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        backoff, failures = 0.05, 0
        while not self._stop.is_set():
            try:
                if self._stream():
                    backoff, failures = 0.05, 0
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if not self._created.is_set():
                    error = rpc_error(f"watch {self._prefix!r}", err, 0)
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        self._first_error = error
                        self._created.set()
                        return
                    # Not reached yet (etcd starting, or a handshake that failed on a loaded
                    # machine): tried again until `start` gives up, as reads are.
                    self._unreachable = error
                    log.debug("opening watch %r: %s; trying again", self._prefix, error)
                else:
                    # A stream lost once is routine (etcd's leader changed, a member went
                    # away) and reopens at once; one that keeps failing is worth a warning.
                    failures += 1
                    level = {1: logging.INFO, _WARN_AFTER: logging.WARNING}.get(failures)
                    log.log(
                        logging.DEBUG if level is None else level,
                        "watch %r lost its stream (%s, %d time(s) in a row); reopening at "
                        "revision %s",
                        self._prefix,
                        err.code().name,
                        failures,
                        self._next_revision,
                    )
            if self._stop.wait(backoff):
                return
            backoff = min(2 * backoff, 1.0)

    def _stream(self) -> bool:
        """Read one stream until it ends; True if etcd accepted the watch on it."""
        done = threading.Event()
        create = etcdrpc.WatchCreateRequest(
            key=self._key, range_end=self._range_end, start_revision=self._next_revision or 0
        )

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # our side of the stream stays open until the watch ends

        call = self._stub.Watch(requests(), metadata=_REQUIRE_LEADER)
        with self._lock:
            self._call, self._stream_done = call, done
        if self._stop.is_set():  # cancel() ran before it could see this call
            done.set()
            call.cancel()
            return False
        created = False
        try:
            for response in call:
                # A refused watch is created and cancelled in the same answer.
                if response.canceled and "permission denied" in response.cancel_reason:
                    self._deny(response.cancel_reason)
                    return False
                if response.created:
                    created = True
                    if self._created.is_set():
                        log.info(
                            "watch %r resumed at revision %s", self._prefix, self._next_revision
                        )
                    if self._next_revision is None:
                        self._next_revision = int(response.header.revision) + 1
                    self._created.set()
                if response.compact_revision:
                    log.error(
                        "watch %r: events from revision %s to %s were compacted away; "
                        "resuming at %s",
                        self._prefix,
                        self._next_revision,
                        response.compact_revision - 1,
                        response.compact_revision,
                    )
                    self._next_revision = int(response.compact_revision)
                    return created
                if response.canceled:
                    log.warning(
                        "watch %r cancelled by etcd: %s", self._prefix, response.cancel_reason
                    )
                    return created
                for raw in response.events:
                    self._deliver(raw)
            return created
        finally:
            done.set()
            call.cancel()

    def _deny(self, reason: str) -> None:
        """etcd refused the watch for these credentials: asking again cannot help."""
        error = KVDenied(f"watch {self._prefix!r}: etcd refused it: {reason}")
        self._stop.set()
        if not self._created.is_set():
            self._first_error = error
            self._created.set()
        else:
            log.error("%s; the watch ends", error)

    def _deliver(self, raw: Any) -> None:
        if self._stop.is_set():
            return
        kv = raw.kv
        key = kv.key.decode(errors="surrogateescape")
        if raw.type == kv_pb2.Event.DELETE:
            event = WatchEvent("delete", key, None, int(kv.mod_revision))
        else:
            event = WatchEvent("put", key, bytes(kv.value), int(kv.mod_revision))
        self._next_revision = event.revision + 1
        try:
            self._callback(event)
        except Exception:
            log.exception("watch callback for prefix %r failed on %s", self._prefix, event)
