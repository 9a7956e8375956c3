"""The agent's half of the local link: accepts its workers and answers their requests.

Where it sits: `NodeAgent` starts one server on the node's abstract socket address; each
request is decoded into its message type (`protocol.messages`) and handed to the handler
(`node/requests`) on a thread of its own, because some requests block (admission, the
next epoch) and must never hold up the others. Errors become typed error replies: a line
that does not decode gets BAD_REQUEST, a handler's exception its code (`error_reply`).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from keepstep.agent.protocol.link import BadFrame, Connection, Frame, LinkClosed, native_address
from keepstep.agent.protocol.messages import Message, Reply, error_reply
from keepstep.errors import KeepstepError

log = logging.getLogger(__name__)

# A request's answer, or None for a report (which is not answered).
Handler = Callable[[Connection, Message], Reply | None]


class LinkServer:
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
            conn = Connection(sock)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                frame = conn.receive()
            except BadFrame as error:
                log.warning("link: %s", error)
                if error.ident is not None:
                    self._answer(conn, error_reply(error), error.ident)
                continue
            if frame is None:
                break
            threading.Thread(target=self._dispatch, args=(conn, frame), daemon=True).start()
        if self.on_disconnect is not None:
            self.on_disconnect(conn)
        conn.close()  # requests still running find it closed (LinkClosed): the worker is gone

    def _dispatch(self, conn: Connection, frame: Frame) -> None:
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

    @staticmethod
    def _answer(conn: Connection, reply: Reply, ident: int) -> None:
        try:
            conn.send(reply, ident)
        except LinkClosed:
            pass  # the worker is gone; its agent learns of that from its exit

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
