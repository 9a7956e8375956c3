"""The local channel between a node agent and its training processes.

A Unix socket in the abstract namespace (no file to clean up, no path-length limit),
carrying one JSON object per line. Workers send requests (`op`, `id`) and get a reply
with the same `id`; some requests are notifications and get none. The agent can also
push messages (no `id`), which the worker's reader thread hands to a callback.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from keepstep.elastic.errors import KeepstepError

log = logging.getLogger(__name__)

Message = dict[str, Any]


class LinkClosed(KeepstepError):
    """The other side of the link went away."""


def socket_address(job: str, node: str) -> str:
    """Written with a leading "@" (it travels in environment variables, which cannot hold
    the NUL byte that starts an abstract socket name); `_native` converts it."""
    return f"@keepstep/{job}/{node}"


def _native(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


class Connection:
    """One end of a link: thread-safe line-delimited JSON over a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._reader = sock.makefile("rb")

    def send(self, message: Message) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as error:
                raise LinkClosed(str(error)) from error

    def receive(self) -> Message | None:
        try:
            line = self._reader.readline()
        except OSError:
            return None
        if not line:
            return None
        message: Message = json.loads(line)
        return message

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


Handler = Callable[[Connection, Message], Message | None]


class LinkServer:
    """Agent side: accepts workers; each request runs `handler` on its own thread.

    A handler returns the reply (sent with the request's id) or None for notifications.
    Requests may block (waiting for an epoch); they never hold up other requests.
    """

    def __init__(
        self,
        address: str,
        handler: Handler,
        on_disconnect: Callable[[Connection], None] | None = None,
    ) -> None:
        self.address = address
        self.handler = handler
        self.on_disconnect = on_disconnect
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_native(address))
        self._sock.listen(64)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="link-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            conn = Connection(sock)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        while True:
            message = conn.receive()
            if message is None:
                break
            threading.Thread(target=self._dispatch, args=(conn, message), daemon=True).start()
        if self.on_disconnect is not None:
            self.on_disconnect(conn)

    def _dispatch(self, conn: Connection, message: Message) -> None:
        try:
            reply = self.handler(conn, message)
        except Exception as error:  # a handler bug must not kill the link: report it
            log.exception("link handler failed for %s", message.get("op"))
            reply = {"error": f"{type(error).__name__}: {error}"}
        if reply is not None and "id" in message:
            reply = dict(reply, id=message["id"])
            try:
                conn.send(reply)
            except LinkClosed:
                pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()


class LinkClient:
    """Worker side: request/reply over the link, plus pushed messages to a callback."""

    def __init__(self, address: str, on_push: Callable[[Message], None], timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_native(address))
        except OSError as error:
            raise LinkClosed(f"cannot reach the node agent at {address!r}: {error}") from error
        sock.settimeout(None)
        self.conn = Connection(sock)
        self.on_push = on_push
        self._next = 0
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[Message]]] = {}
        self._closed = threading.Event()
        threading.Thread(target=self._read, name="link-read", daemon=True).start()

    def _read(self) -> None:
        while True:
            message = self.conn.receive()
            if message is None:
                break
            if "id" in message:
                with self._lock:
                    slot = self._waiting.pop(message["id"], None)
                if slot is not None:
                    slot[1].append(message)
                    slot[0].set()
            else:
                self.on_push(message)
        self._closed.set()
        with self._lock:
            for event, _ in self._waiting.values():
                event.set()

    def request(self, op: str, timeout: float, **fields: Any) -> Message:
        event: threading.Event = threading.Event()
        box: list[Message] = []
        with self._lock:
            self._next += 1
            ident = self._next
            self._waiting[ident] = (event, box)
        self.conn.send({"op": op, "id": ident, **fields})
        if not event.wait(timeout):
            with self._lock:
                self._waiting.pop(ident, None)
            raise TimeoutError(f"node agent did not answer {op!r} within {timeout:.1f} s")
        if not box:
            raise LinkClosed(f"node agent went away during {op!r}")
        reply = box[0]
        if "error" in reply:
            raise KeepstepError(f"node agent failed {op!r}: {reply['error']}")
        return reply

    def notify(self, op: str, **fields: Any) -> None:
        self.conn.send({"op": op, **fields})

    def close(self) -> None:
        self.conn.close()
