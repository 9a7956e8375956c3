"""The local channel between a node agent and its training processes: the shared framing.

A Unix socket in the abstract namespace (no file to clean up, no path-length limit),
carrying one JSON object per line: a typed message (`messages`) and, on a request and
its reply, the request's `id`. Reports (commits) carry no id and get no reply; the agent
pushes messages with no id, which the worker's reader hands to a callback.

Where it sits: the agent's half (accepting its own workers only, a bounded number of
threads) is `node/link_server`, the worker's half (request and wait, bounded)
`worker/link_client`; both speak through `Connection` here, which never reads more than
`MAX_LINE_BYTES` of one line into memory (a longer one ends the connection:
FrameTooLong). `AnswerBounds` is how long the worker waits for each kind of answer: the
agent computes it from its own bounds and hands it over in the worker's environment, so
that both sides agree when a silent agent is wedged.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from keepstep.agent.protocol.messages import BadMessage, LinkError, Message, decode, encode
from keepstep.errors import ConfigError, KeepstepError

# The longest line either side reads. The longest real message, a commit naming every
# member's micro-batches, is a few KiB for thousands of micro-batches; a peer that sends a
# longer line is broken or hostile, and its line is not read into memory.
MAX_LINE_BYTES = 1 << 20


class LinkClosed(KeepstepError):
    """The other side of the link went away."""


class BadFrame(BadMessage):
    """A line that does not decode; `ident` is its request id when that much was readable,
    so the agent can still answer the request with an error."""

    def __init__(self, ident: int | None, error: BadMessage) -> None:
        super().__init__(error.field, error.problem)
        self.ident = ident


class FrameTooLong(LinkError):
    """A line longer than the link allows. What follows it cannot be trusted to be the
    start of a message, so the connection is given up."""


def socket_address(job: str, node: str) -> str:
    """Written with a leading "@" (it travels in environment variables, which cannot hold
    the NUL byte that starts an abstract socket name); `native_address` converts it."""
    return f"@keepstep/{job}/{node}"


def native_address(address: str) -> str:
    return "\0" + address[1:] if address.startswith("@") else address


@dataclass(frozen=True)
class Frame:
    """One line of the link: a message, and the id of the request it is or answers."""

    message: Message
    ident: int | None = None


class Connection:
    """One end of a link: thread-safe line-delimited JSON over a stream socket; a line
    longer than `max_line` bytes (newline included) is not read (FrameTooLong)."""

    def __init__(self, sock: socket.socket, max_line: int = MAX_LINE_BYTES) -> None:
        self.sock = sock
        self.max_line = max_line
        self._send_lock = threading.Lock()
        self._reader = sock.makefile("rb")

    def send(self, message: Message, ident: int | None = None) -> None:
        obj = encode(message)
        if ident is not None:
            obj["id"] = ident
        data = (json.dumps(obj) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as error:
                raise LinkClosed(str(error)) from error

    def receive(self) -> Frame | None:
        """The next frame; None once the other side closed. BadFrame for a line that does
        not decode (the link stays usable: the next line is the next message); FrameTooLong
        for one longer than `max_line`, of which at most that much was read (the link is
        not usable any more: close it)."""
        try:
            line = self._reader.readline(self.max_line + 1)
        except (OSError, ValueError):  # ValueError: closed meanwhile by another thread
            return None
        if not line:
            return None
        if len(line) > self.max_line:
            raise FrameTooLong(f"a line longer than {self.max_line} bytes")
        try:
            obj = json.loads(line)
        except ValueError as error:
            raise BadFrame(None, BadMessage(None, f"not JSON: {error}")) from None
        ident = obj.pop("id", None) if isinstance(obj, dict) else None
        if ident is not None and (isinstance(ident, bool) or not isinstance(ident, int)):
            raise BadFrame(None, BadMessage("id", f"expected int, got {ident!r}"))
        try:
            return Frame(decode(obj), ident)
        except BadMessage as error:
            raise BadFrame(ident, error) from None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a reader blocked in receive()
        except OSError:
            pass
        self.sock.close()
        # The socket is released only once its file is closed too (the file holds it).
        self._reader.close()


# The environment variables that carry `AnswerBounds` to a worker.
REPLY_TIMEOUT_ENV = "KEEPSTEP_REPLY_TIMEOUT"
DECISION_TIMEOUT_ENV = "KEEPSTEP_DECISION_TIMEOUT"
ADMISSION_TIMEOUT_ENV = "KEEPSTEP_ADMISSION_TIMEOUT"


@dataclass(frozen=True)
class AnswerBounds:
    """How long a worker waits for each kind of answer (seconds). Past one, the agent is
    taken for wedged and the worker raises AgentUnresponsive instead of hanging.

    reply      hello, finish: answered at once
    decision   boundary, failure: probes, a few etcd writes, the agreed epoch appearing
    admission  initial: until an epoch admits the worker (a joiner waits for a boundary)
    """

    reply: float = 30.0
    decision: float = 90.0
    admission: float = 3700.0

    def __post_init__(self) -> None:
        for name in ("reply", "decision", "admission"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"AnswerBounds.{name}={value!r}: must be seconds > 0")

    def env(self) -> dict[str, str]:
        return {
            REPLY_TIMEOUT_ENV: repr(self.reply),
            DECISION_TIMEOUT_ENV: repr(self.decision),
            ADMISSION_TIMEOUT_ENV: repr(self.admission),
        }

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AnswerBounds:
        """The bounds the agent set; a variable that is absent keeps its default."""
        default = cls()
        values: dict[str, float] = {}
        for name, var in (
            ("reply", REPLY_TIMEOUT_ENV),
            ("decision", DECISION_TIMEOUT_ENV),
            ("admission", ADMISSION_TIMEOUT_ENV),
        ):
            text = env.get(var)
            try:
                values[name] = float(text) if text is not None else getattr(default, name)
            except ValueError:
                raise ConfigError(f"{var}={text!r}: must be a number of seconds") from None
        return cls(**values)
