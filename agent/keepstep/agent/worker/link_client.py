"""The worker's half of the local link: typed requests to its node agent, each bounded.

Where it sits: inside the training process, under `worker/controller`. A request waits
for its reply at most the bound the caller names (`AnswerBounds`); an agent that stays
silent past it raises AgentUnresponsive, and one that answers with an error raises that
error's type (`messages.error_of`). A reader thread matches replies to requests by id
and hands pushed messages (the "change pending" flag) to a callback. It reads at most
`MAX_LINE_BYTES` of a line: a longer one ends the link (waiting requests get LinkClosed).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from keepstep.agent.protocol.link import (
    BadFrame,
    Connection,
    FrameTooLong,
    LinkClosed,
    native_address,
)
from keepstep.agent.protocol.messages import (
    AgentUnresponsive,
    BadMessage,
    ErrorReply,
    Message,
    Reply,
    Report,
    Request,
    error_of,
)

log = logging.getLogger(__name__)

Answer = Reply | BadMessage  # what the reader hands a waiting request


class _Waiting:
    """One request waiting for its answer."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.answer: Answer | None = None  # None when woken because the link closed


class LinkClient:
    def __init__(self, address: str, on_push: Callable[[Message], None], timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(native_address(address))
        except OSError as error:
            raise LinkClosed(f"cannot reach the node agent at {address!r}: {error}") from error
        sock.settimeout(None)
        self.conn = Connection(sock)
        self.on_push = on_push
        self._next = 0
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}
        self._closed = False
        threading.Thread(target=self._read, name="link-read", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                frame = self.conn.receive()
            except FrameTooLong as error:
                log.warning("link: %s from the agent: closing the link", error)
                self.conn.close()
                break
            except BadFrame as error:
                if error.ident is None:
                    log.warning("link: dropped a message from the agent: %s", error)
                else:
                    self._deliver(error.ident, error)
                continue
            if frame is None:
                break
            if frame.ident is None:
                self.on_push(frame.message)
            elif isinstance(frame.message, Reply):
                self._deliver(frame.ident, frame.message)
            else:
                op = frame.message.OP.value
                self._deliver(frame.ident, BadMessage("op", f"{op!r} is not a reply"))
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting.values()), {}
        for slot in waiting:
            slot.event.set()

    def _deliver(self, ident: int, answer: Answer) -> None:
        with self._lock:
            slot = self._waiting.pop(ident, None)
        if slot is not None:
            slot.answer = answer
            slot.event.set()

    def request(self, message: Request, timeout: float) -> Reply:
        """The agent's reply to `message`, waited for at most `timeout` seconds.

        AgentUnresponsive past the bound, LinkClosed if the agent went away, and the
        error's own type (AdmissionTimeout, JobCannotContinue, ...) for an error reply.
        """
        op = message.OP.value
        slot = _Waiting()
        with self._lock:
            if self._closed:
                raise LinkClosed(f"the link to the node agent is closed ({op!r})")
            self._next += 1
            ident = self._next
            self._waiting[ident] = slot
        self.conn.send(message, ident)
        if not slot.event.wait(timeout):
            with self._lock:
                self._waiting.pop(ident, None)
            raise AgentUnresponsive(f"the node agent did not answer {op!r} within {timeout:.1f} s")
        answer = slot.answer
        if answer is None:
            raise LinkClosed(f"the node agent went away during {op!r}")
        if isinstance(answer, BadMessage):
            raise answer
        if isinstance(answer, ErrorReply):
            raise error_of(answer)
        return answer

    def report(self, message: Report) -> None:
        """Send a report; the agent does not answer it."""
        self.conn.send(message)

    def close(self) -> None:
        self.conn.close()
