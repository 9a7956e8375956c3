"""One long-lived LeaseKeepAlive stream per kept-alive lease.

Where it sits: `EtcdKV.keepalive` (etcd.py) beats through a `KeepAliveStream`; nothing else
uses it. Opening a stream per beat costs a gRPC stream set-up on both sides and a thread
that gRPC starts to feed the request, several times a second per agent, and on a machine
whose cores all train that CPU comes out of the step. Here a beat writes one request into
the open stream and waits for its answer under the beat's own timeout; any failure (no
answer in time, an error, the stream ended) closes the stream, and the next beat opens a
new one, on whichever member the channel picks.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import grpc
from pyetcd import etcdrpc

from keepstep.agent.kv import KVError, KVTimeout, LeaseLost
from keepstep.agent.kv.etcd_watch import rpc_error

_END = object()  # ends the request iterator: gRPC half-closes the stream


class KeepAliveStream:
    """Refreshes one lease over one stream, reopened after any failure.

    Use from one thread (the lease's keepalive thread); `close` may come from any.
    """

    def __init__(self, stub: Any, lease_id: int) -> None:
        self._stub = stub
        self._lease_id = lease_id
        self._what = f"refresh lease {lease_id:x}"
        self._lock = threading.Lock()
        self._call: Any | None = None
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False

    def refresh(self, timeout: float) -> None:
        """One keepalive: LeaseLost if etcd no longer has the lease, KVTimeout if no
        answer came within `timeout`, KVError for anything else."""
        requests, answers = self._open()
        requests.put(etcdrpc.LeaseKeepAliveRequest(ID=self._lease_id))
        try:
            answer = answers.get(timeout=timeout)
        except queue.Empty:
            answer = KVTimeout(f"{self._what}: etcd did not answer within {timeout} s")
        if isinstance(answer, grpc.RpcError):
            answer = rpc_error(self._what, answer, timeout)
        error = answer if isinstance(answer, KVError) else lease_answer(self._what, answer)
        if error is not None:
            self._drop()
            raise error

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop()

    def _open(self) -> tuple[queue.SimpleQueue[object], queue.SimpleQueue[object]]:
        with self._lock:
            if self._closed:
                raise KVError(f"{self._what}: the keepalive was stopped")
            if self._call is None:
                # Fresh queues: nothing of a dropped stream can be read as this one's.
                self._requests, self._answers = queue.SimpleQueue(), queue.SimpleQueue()
                requests, answers = self._requests, self._answers
                self._call = self._stub.LeaseKeepAlive(iter(requests.get, _END))
                threading.Thread(
                    target=_read,
                    args=(self._call, answers, self._what),
                    name=f"keepstep-keepalive-read-{self._lease_id:x}",
                    daemon=True,
                ).start()
            return self._requests, self._answers

    def _drop(self) -> None:
        with self._lock:
            call, self._call = self._call, None
            requests = self._requests
        if call is not None:
            requests.put(_END)
            call.cancel()


def lease_answer(what: str, response: Any) -> LeaseLost | None:
    """LeaseLost when a LeaseKeepAlive answer says etcd no longer has the lease (TTL <= 0)."""
    if response.TTL <= 0:
        return LeaseLost(f"{what}: the lease has expired or was revoked")
    return None


def _read(call: Any, answers: queue.SimpleQueue[object], what: str) -> None:
    """Hand every answer of the stream to the beat waiting for it, then how it ended."""
    try:
        for response in call:
            answers.put(response)
        answers.put(KVError(f"{what}: etcd closed the keepalive stream"))
    except grpc.RpcError as err:
        answers.put(err)
