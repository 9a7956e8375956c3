"""Who may talk to a node agent over its link, and what one peer can cost the agent.

- A process that is not one of the agent's own (its workers, warm spares, and what they
  start) is refused before a byte of it is read, with a warning.
- The process tree decides who is the agent's own: its children and theirs, not its parent.
- A line longer than the bound is not read into memory: the connection is closed, and
  other connections go on. The worker's side bounds what it reads the same way.
- A connection's requests beyond the in-flight bound wait, holding up no other
  connection; connections beyond the bound are refused.
- A JSON message that carries a pickle in a field is data: nothing unpickles it.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import socket
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent.node.link_server import LinkServer, same_user_and
from keepstep.agent.node.supervisor import Supervisor, descends_from
from keepstep.agent.protocol.link import (
    Connection,
    FrameTooLong,
    LinkClosed,
    native_address,
    socket_address,
)
from keepstep.agent.protocol.messages import (
    ErrorCode,
    Hello,
    Initial,
    Message,
    Ok,
    Reply,
    encode,
)
from keepstep.agent.worker.link_client import LinkClient

T = 10.0


def address(tag: str) -> str:
    return socket_address(f"link-{tag}-{os.getpid()}-{time.monotonic_ns()}", "n0")


def raw(addr: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(T)
    sock.connect(native_address(addr))
    return sock


def line(message: Message, ident: int | None = None) -> bytes:
    obj = encode(message)
    if ident is not None:
        obj["id"] = ident
    return (json.dumps(obj) + "\n").encode()


def answer(sock: socket.socket) -> object:
    """The next line the server wrote, decoded."""
    with sock.makefile("rb") as lines:
        return json.loads(lines.readline())


def closed_unanswered(sock: socket.socket) -> bool:
    """Whether the other side closed without writing anything."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


class Handled:
    """A handler that records what it was asked and answers Ok (Initial: when released)."""

    def __init__(self) -> None:
        self.asked: list[Message] = []
        self.release = threading.Event()
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def __call__(self, conn: Connection, message: Message) -> Reply | None:
        with self._lock:
            self.asked.append(message)
        if not isinstance(message, Initial):
            return Ok()
        with self._lock:
            self.running += 1  # admissions under way
            self.most = max(self.most, self.running)
        try:
            self.release.wait(T)
            return Ok()
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def handled() -> Iterator[Handled]:
    h = Handled()
    yield h
    h.release.set()


def test_a_peer_that_is_not_the_agents_own_is_refused_unread(
    handled: Handled, caplog: pytest.LogCaptureFixture
) -> None:
    addr = address("refused")
    seen: list[int] = []

    def owns(pid: int) -> bool:
        seen.append(pid)
        return False

    server = LinkServer(addr, handled, admit=same_user_and(owns))
    try:
        with caplog.at_level(logging.WARNING), raw(addr) as sock:
            try:
                sock.sendall(line(Hello("n0/0"), 1))
            except BrokenPipeError:
                pass  # the server closed the connection before the line went out
            assert closed_unanswered(sock)
        assert seen == [os.getpid()]  # the kernel's word on who connected
        assert handled.asked == []
        assert "refused a connection" in caplog.text
        assert f"pid {os.getpid()} is not one of this agent's workers" in caplog.text
    finally:
        server.close()


def test_the_agents_own_processes_are_its_process_tree() -> None:
    owns = Supervisor(lambda member, pid, code: None).owns
    assert owns(os.getpid())  # the agent itself (tests speak for workers in-process)
    assert not owns(os.getppid())  # whoever started the agent is not its worker
    assert not owns(1)
    # A worker whose command is a wrapper: its child is the agent's too.
    with subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE
    ) as wrapper:
        assert wrapper.stdout is not None
        grandchild = int(wrapper.stdout.readline())
        try:
            assert owns(wrapper.pid) and owns(grandchild)
            assert descends_from(grandchild, wrapper.pid)
            assert not descends_from(wrapper.pid, grandchild)
        finally:
            os.kill(grandchild, 9)
            wrapper.kill()
    assert not owns(wrapper.pid)  # gone
    assert not descends_from(2**22 + 1, os.getpid())  # no such process


def test_a_line_longer_than_the_bound_is_not_read_into_memory() -> None:
    ours, theirs = socket.socketpair()
    conn = Connection(ours)
    sent = threading.Thread(target=lambda: _send_quietly(theirs, b"x" * (8 << 20)), daemon=True)
    sent.start()
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLong, match="longer than 1048576 bytes"):
            conn.receive()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        conn.close()
        theirs.close()
        sent.join(T)
    assert peak < 3 << 20, peak  # the line's first MiB, not its 8


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the reader closed the connection: what it is meant to do


def test_an_oversized_line_closes_its_connection_and_no_other(
    handled: Handled, caplog: pytest.LogCaptureFixture
) -> None:
    addr = address("long")
    server = LinkServer(addr, handled)
    try:
        with caplog.at_level(logging.WARNING), raw(addr) as bad, raw(addr) as good:
            threading.Thread(
                target=_send_quietly, args=(bad, b"{" * (2 << 20)), daemon=True
            ).start()
            assert closed_unanswered(bad)
            good.sendall(line(Hello("n0/0"), 7))
            assert answer(good) == {"op": "ok", "id": 7}
        assert "longer than 1048576 bytes: closing the connection" in caplog.text
    finally:
        server.close()


def test_the_worker_side_bounds_what_it_reads_too() -> None:
    addr = address("agent-floods")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(native_address(addr))
    listener.listen(1)

    def flood() -> None:
        peer, _ = listener.accept()
        with peer:
            _send_quietly(peer, b"[" * (4 << 20))

    threading.Thread(target=flood, daemon=True).start()
    client = LinkClient(addr, lambda message: None, T)
    try:
        t0 = time.monotonic()
        with pytest.raises(LinkClosed):
            client.request(Hello("n0/0"), T)
        assert time.monotonic() - t0 < T / 2  # closed at once, not timed out
    finally:
        client.close()
        listener.close()


def test_requests_past_the_in_flight_bound_wait_and_hold_up_no_other_connection(
    handled: Handled,
) -> None:
    addr = address("bounded")
    server = LinkServer(addr, handled, max_in_flight=2)
    try:
        with raw(addr) as busy, raw(addr) as other:
            for ident in (1, 2, 3):  # three admissions that block, on one connection
                busy.sendall(line(Initial("n0/0"), ident))
            deadline = time.monotonic() + T
            while handled.running < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            other.sendall(line(Hello("n0/1"), 9))
            assert answer(other) == {"op": "ok", "id": 9}
            assert handled.running == 2  # the third waits for a slot, unread
            handled.release.set()
            with busy.makefile("rb") as answers:
                ids = sorted(json.loads(answers.readline())["id"] for _ in range(3))
            assert ids == [1, 2, 3]
        assert handled.most == 2
    finally:
        server.close()


def test_connections_past_the_bound_are_refused_until_one_ends(handled: Handled) -> None:
    addr = address("many")
    server = LinkServer(addr, handled, max_connections=2)
    first, second = raw(addr), raw(addr)
    try:
        with raw(addr) as third:
            assert closed_unanswered(third)
        first.close()
        deadline = time.monotonic() + T
        while True:  # the slot is free once the server has seen the close
            with raw(addr) as again:
                try:
                    again.sendall(line(Hello("n0/0"), 1))
                except BrokenPipeError:
                    pass  # refused and closed before the line went out: still full
                if not closed_unanswered(again):
                    break
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.close()
        second.close()
        server.close()


class _Touch:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.path),))


def test_a_pickle_in_a_field_is_only_data(handled: Handled, tmp_path: Path) -> None:
    addr = address("pickle")
    marker = tmp_path / "unpickled"
    payload = base64.b64encode(pickle.dumps(_Touch(marker))).decode()
    server = LinkServer(addr, handled)
    try:
        with raw(addr) as sock, sock.makefile("rb") as answers:
            sock.sendall(json.dumps({"op": "hello", "member": payload, "id": 1}).encode() + b"\n")
            assert json.loads(answers.readline()) == {"op": "ok", "id": 1}
            extra = {"op": "hello", "member": "n0/0", "state": payload, "id": 2}
            sock.sendall(json.dumps(extra).encode() + b"\n")
            refused = json.loads(answers.readline())
        assert refused["op"] == "error" and refused["code"] == ErrorCode.BAD_REQUEST.value
        assert refused["reason"].startswith("bad link message: state: not a field")
        assert handled.asked == [Hello(payload)]  # a string, handed on as a string
        assert not marker.exists()
    finally:
        server.close()
