"""The agent's answers to its workers: a connection speaks only for the member it said
hello as (no report, failure or finish in another worker's name)."""

from __future__ import annotations

from typing import Any

import pytest

from keepstep.agent.node.requests import WorkerRequests
from keepstep.agent.node.workers import WorkerTable
from keepstep.agent.protocol.messages import BadMessage, Commit, Finish, Hello, Ok


class Conn:
    """A link connection that keeps what the agent pushes to it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any, ident: int | None = None) -> None:
        self.sent.append(message)


class Recorder:
    """Stands in for the healer, reports, progress and event log: records what reached it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kw: self.calls.append((name, args))


def commit(member: str) -> Commit:
    return Commit(member, 3, 1, 2, (0,), (0, 1), 0.1)


@pytest.fixture
def setup() -> tuple[WorkerRequests, Recorder]:
    sink = Recorder()
    table = WorkerTable(["n0/0", "n0/1"])
    return WorkerRequests(table, sink, sink, sink, sink, lambda _: None), sink  # type: ignore[arg-type]


def test_a_connection_speaks_for_the_member_it_said_hello_as(
    setup: tuple[WorkerRequests, Recorder],
) -> None:
    requests, sink = setup
    first, second = Conn(), Conn()
    assert requests.handle(first, Hello("n0/0")) == Ok()  # type: ignore[arg-type]
    assert requests.handle(second, Hello("n0/1")) == Ok()  # type: ignore[arg-type]
    requests.handle(first, commit("n0/0"))  # type: ignore[arg-type]
    assert ("commit", (commit("n0/0"),)) in sink.calls
    cases = [
        (first, commit("n0/1"), "'n0/1': this connection said hello as 'n0/0'"),
        (first, Finish("n0/1", 3, "ab" * 32), "this connection said hello as 'n0/0'"),
        (Conn(), commit("n0/0"), "'n0/0': this connection said no hello"),
        (first, Hello("n0/1"), "this connection said hello as 'n0/0', not 'n0/1'"),
        (Conn(), Hello("n0/0"), "'n0/0' is connected already, on another connection"),
    ]
    for conn, message, words in cases:
        before = list(sink.calls)
        with pytest.raises(BadMessage, match=words):
            requests.handle(conn, message)  # type: ignore[arg-type]
        assert sink.calls[len(before) :] == [], f"{message} reached the agent"


def test_a_restarted_worker_says_hello_on_its_new_connection(
    setup: tuple[WorkerRequests, Recorder],
) -> None:
    requests, _ = setup
    old, new = Conn(), Conn()
    requests.handle(old, Hello("n0/0"))  # type: ignore[arg-type]
    requests.workers.exited("n0/0", -9)  # its process died; the supervisor restarts it
    requests.workers.restarted("n0/0")
    assert requests.handle(new, Hello("n0/0")) == Ok()  # type: ignore[arg-type]
    with pytest.raises(BadMessage, match="this connection said no hello"):
        requests.handle(old, commit("n0/0"))  # type: ignore[arg-type]
