"""A worker's state in its agent: the phases and transitions `node/workers.py` writes down."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from keepstep.agent.node.workers import WorkerPhase, WorkerState, WorkerTable
from keepstep.agent.protocol.link import Connection
from keepstep.agent.protocol.messages import Reconfigured


@pytest.fixture
def conns() -> Iterator[tuple[Connection, Connection]]:
    left, right = socket.socketpair()
    a, b = Connection(left), Connection(right)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_worker_that_finishes_is_done_whatever_its_exit(
    conns: tuple[Connection, Connection],
) -> None:
    conn, _ = conns
    state = WorkerState().hello(conn)
    assert (state.phase, state.conn) == (WorkerPhase.READY, conn)
    state = state.finished()
    assert state.phase is WorkerPhase.FINISHED
    state = state.exited(-6)  # SIGABRT at interpreter exit
    assert (state.phase, state.exit_code, state.conn) == (WorkerPhase.FINISHED, -6, None)
    assert state.ended_well
    assert state.restarted() == state  # a finished worker is never restarted


def test_crashes_in_a_row_count_until_a_commit(conns: tuple[Connection, Connection]) -> None:
    conn, _ = conns
    state = WorkerState().hello(conn).exited(-9)
    assert (state.phase, state.exit_code, state.conn) == (WorkerPhase.EXITED, -9, None)
    assert not state.ended_well
    state = state.restarted()
    assert (state.phase, state.restarts) == (WorkerPhase.STARTING, 1)
    state = state.exited(1).restarted()
    assert state.restarts == 2
    assert state.committed().restarts == 0
    assert WorkerState().exited(0).ended_well  # left the job (drained) with status 0


def test_what_does_not_apply_to_the_phase_leaves_the_state_alone(
    conns: tuple[Connection, Connection],
) -> None:
    old, new = conns
    exited = WorkerState().hello(old).exited(-9)
    assert exited.hello(old) == exited  # the hello of a process whose exit came first
    assert exited.finished() == exited
    ready = exited.restarted().hello(new)
    assert ready.disconnected(old) == ready  # the old process's link closing late
    gone = ready.disconnected(new)
    assert (gone.phase, gone.conn) == (WorkerPhase.DISCONNECTED, None)
    assert gone.hello(new) == gone
    assert WorkerState().restarted() == WorkerState()  # only an exited worker restarts


def test_the_table_offers_ready_workers_and_tells_them_each_flag_change(
    conns: tuple[Connection, Connection],
) -> None:
    a, b = conns
    table = WorkerTable(["n0/0", "n0/1"])
    assert "n0/1" in table and "n1/0" not in table
    assert table.ready() == []
    assert table.hello("n0/1", a) == (table.get("n0/1"), False)
    assert table.ready() == ["n0/1"]
    assert table.set_flag(True) == [a]
    assert table.set_flag(True) == []  # unchanged: nothing to push
    _, flag = table.hello("n0/0", b)
    assert flag is True  # a worker saying hello after the change still learns of it
    table.finished("n0/0")
    assert table.ready() == ["n0/1"]  # a finished worker is offered to no epoch
    table.disconnected(a)
    assert table.ready() == [] and table.get("n0/1").phase is WorkerPhase.DISCONNECTED
    entered = Reconfigured("n0/1", 2, ("n0/1",), 0.1, 0.0, 0.0, 4, 0, True)
    assert table.entering("n0/1", entered).entered == entered
    table.exited("n0/0", -6)
    table.exited("n0/1", 0)
    assert table.ended_well()
    assert table.exit_codes() == {"n0/0": -6, "n0/1": 0}
