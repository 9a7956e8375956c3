"""The agent's half of the local link: accepts its own workers and answers their requests.

Where it sits: `NodeAgent` starts one server on the node's abstract socket address; each
request is decoded into its message type (`protocol.messages`) and handed to the handler
(`node/requests`) on a thread of its own, because some requests block (admission, the
next epoch) and must never hold up the others. Errors become typed error replies: a line
that does not decode gets BAD_REQUEST, a handler's exception its code (`error_reply`).

Who may talk to the agent: an abstract socket has no file permissions, so any process of
the network namespace can connect. Each connecting peer's credentials (SO_PEERCRED, from
the kernel) are checked first (`admit`; by default the same user as the agent, and a
process the agent started: see `Supervisor.owns`); anyone else is refused, with a
warning, before a byte of theirs is read.

What one peer can cost the agent is bounded: a line is read up to `MAX_LINE_BYTES` (a
longer one closes the connection, unread), at most `max_connections` connections are
served at once (one reader thread each), and a connection has at most `max_in_flight`
requests under way (one thread each); past that its reader waits for one to end before it
reads on, which holds up that connection only.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from keepstep.agent.node.supervisor import descends_from
from keepstep.agent.protocol.link import (
    BadFrame,
    Connection,
    Frame,
    FrameTooLong,
    LinkClosed,
    native_address,
)
from keepstep.agent.protocol.messages import Message, Reply, error_reply
from keepstep.errors import KeepstepError

log = logging.getLogger(__name__)

# A request's answer, or None for a report (which is not answered).
Handler = Callable[[Connection, Message], Reply | None]

MAX_CONNECTIONS = 64  # a node's workers hold one each; far more than any node runs
MAX_IN_FLIGHT = 8  # a worker asks one question at a time (its reports are not answered)
_SLOT_WAIT_S = 1.0  # how often a reader waiting for a request slot looks if it was closed
_WARN_EVERY_S = 1.0  # refusals are logged at most this often (a peer may retry in a loop)


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel saw it connect. A pid
    of 0: the process lives in another pid namespace."""

    pid: int
    uid: int
    gid: int


# Whether to serve a peer: None to admit it, else why it is refused.
Admit = Callable[[Peer], str | None]


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Peer(pid, uid, gid)


def same_user_and(owns: Callable[[int], bool]) -> Admit:
    """Admit a peer run by the agent's own user whose pid `owns` accepts."""

    def admit(peer: Peer) -> str | None:
        if peer.uid != os.geteuid():
            return f"it runs as uid {peer.uid}, not the agent's {os.geteuid()}"
        if peer.pid <= 0 or not owns(peer.pid):
            return f"pid {peer.pid} is not one of this agent's workers"
        return None

    return admit


def own_processes() -> Admit:
    """This process and those it started (and theirs), run by the same user."""
    agent = os.getpid()
    return same_user_and(lambda pid: descends_from(pid, agent))


class LinkServer:
    def __init__(
        self,
        address: str,
        handler: Handler,
        on_disconnect: Callable[[Connection], None] | None = None,
        admit: Admit | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.address = address
        self.handler = handler
        self.on_disconnect = on_disconnect
        self.admit = admit if admit is not None else own_processes()
        self.max_connections, self.max_in_flight = max_connections, max_in_flight
        self._connections = threading.BoundedSemaphore(max_connections)
        self._warned_at = -_WARN_EVERY_S
        self._unwarned = 0  # refusals since the last warning
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(native_address(address))
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
            refusal = self._check(sock)
            if refusal is not None:
                self._refused(refusal)  # said before the peer can see the close
                sock.close()
                continue
            conn = Connection(sock)
            threading.Thread(
                target=self._serve, args=(conn,), name="link-serve", daemon=True
            ).start()

    def _check(self, sock: socket.socket) -> str | None:
        """Why the peer on `sock` is refused (None: admitted, and holding a connection slot)."""
        try:
            peer = peer_of(sock)
        except OSError as error:
            return f"its credentials cannot be read: {error}"
        try:
            refusal = self.admit(peer)
        except OSError as error:
            refusal = f"pid {peer.pid} cannot be checked: {error}"
        if refusal is not None:
            return f"pid {peer.pid}: {refusal}"
        if not self._connections.acquire(blocking=False):
            return f"pid {peer.pid}: {self.max_connections} connections are open already"
        return None

    def _refused(self, why: str) -> None:
        now = time.monotonic()
        if now - self._warned_at < _WARN_EVERY_S:
            self._unwarned += 1
            return
        more = f" ({self._unwarned} more refused since the last warning)" if self._unwarned else ""
        self._warned_at, self._unwarned = now, 0
        log.warning("link %s refused a connection: %s%s", self.address, why, more)

    def _serve(self, conn: Connection) -> None:
        in_flight = threading.BoundedSemaphore(self.max_in_flight)
        try:
            while True:
                try:
                    frame = conn.receive()
                except FrameTooLong as error:
                    log.warning("link: %s: closing the connection", error)
                    break
                except BadFrame as error:
                    log.warning("link: %s", error)
                    if error.ident is not None:
                        self._answer(conn, error_reply(error), error.ident)
                    continue
                if frame is None or not self._slot(in_flight):
                    break
                threading.Thread(
                    target=self._dispatch,
                    args=(conn, frame, in_flight),
                    name="link-request",
                    daemon=True,
                ).start()
            if self.on_disconnect is not None:
                self.on_disconnect(conn)
            conn.close()  # requests still running find it closed (LinkClosed): the worker is gone
        finally:
            self._connections.release()

    def _slot(self, in_flight: threading.BoundedSemaphore) -> bool:
        """Wait until the connection may start another request; False once closed."""
        while not in_flight.acquire(timeout=_SLOT_WAIT_S):
            if self._closed.is_set():
                return False
        return True

    def _dispatch(
        self, conn: Connection, frame: Frame, in_flight: threading.BoundedSemaphore
    ) -> None:
        try:
            try:
                reply = self.handler(conn, frame.message)
            except Exception as error:  # a handler's failure must not kill the link: report it
                if isinstance(error, KeepstepError):  # a failure of the request, named by its type
                    log.warning("link: %s failed: %s", frame.message.OP.value, error)
                else:  # a bug: keep its traceback
                    log.exception("link handler failed for %s", frame.message.OP.value)
                reply = error_reply(error)
            if reply is not None and frame.ident is not None:
                self._answer(conn, reply, frame.ident)
        finally:
            in_flight.release()

    @staticmethod
    def _answer(conn: Connection, reply: Reply, ident: int) -> None:
        try:
            conn.send(reply, ident)
        except LinkClosed:
            pass  # the worker is gone; its agent learns of that from its exit

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
