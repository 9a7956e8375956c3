"""Step gates on one in-memory etcd: the armer's side (`launch.gates`), the agents' side
(`agent.node.gates`) and a worker's controller over a real link.

- A worker that has committed a gate's step holds; the first agent there marks the gate
  held with the step it holds at; the armer claims it, and the worker goes on only once
  the gate is released. Before the step, or after the gate opened, nobody waits.
- A second agent's worker waits on the gate the first one holds.
- A gate nobody claims is expired (bounded); an agent that cannot reach etcd does not hold.
- A gate the job passed unheld is claimed late, with the step the armer saw.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv import MemoryKV, WatchEvent
from keepstep.agent.node.gates import HOLD_TIMEOUT_S, GateHolds, closing, hold_timeout_for
from keepstep.agent.node.link_server import LinkServer
from keepstep.agent.node.requests import WorkerRequests
from keepstep.agent.node.workers import WorkerTable
from keepstep.agent.protocol import GateRecord, GateState
from keepstep.agent.protocol.events import EventLog, read_events
from keepstep.agent.protocol.link import Connection, socket_address
from keepstep.agent.protocol.messages import GatesPush, Hello, Message, Ok
from keepstep.agent.worker.controller import AgentController
from keepstep.launch.gates import GateClient

JOB, T = "gates", 5.0


class Conn:
    """A link connection that keeps what the agent pushes to it."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, message: Message, ident: int | None = None) -> None:
        self.sent.append(message)


LOGS: list[EventLog] = []


@pytest.fixture(autouse=True)
def close_logs() -> Iterator[None]:
    """Every event log a test opened is closed at its end."""
    yield
    for log in LOGS:
        log.close()
    LOGS.clear()


def event_log(path: Path) -> EventLog:
    log = EventLog(path)
    LOGS.append(log)
    return log


def agent(kv: MemoryKV, node: str, tmp: Path, hold_timeout: float = T) -> GateHolds:
    """An agent's gates on a client of its own, fed by a watch as `NodeAgent._apply`."""
    holds = GateHolds(
        kv.client(), JOB, node, event_log(tmp / f"events-{node}.jsonl"), T, hold_timeout
    )

    def seen(event: WatchEvent) -> None:
        holds.apply(event)

    kv.watch_prefix(protocol.prefix(JOB, protocol.GATES), seen)
    return holds


def record(kv: MemoryKV, name: str) -> GateRecord:
    found = kv.get(protocol.key(JOB, protocol.GATES, name), T)
    assert found is not None
    return protocol.decode(GateRecord, found.value)


def in_thread(target: object, *args: object) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_a_whole_hold_fits_in_the_workers_bound_on_its_answer() -> None:
    assert hold_timeout_for(decision=60.0, op_timeout=5.0) == HOLD_TIMEOUT_S
    short = hold_timeout_for(decision=20.0, op_timeout=2.0)
    assert 2 * short + 4 * 2.0 < 20.0


def test_which_gates_a_worker_waits_at() -> None:
    gates = [
        GateRecord("a", 5),
        GateRecord("b", 3, GateState.RELEASED),
        GateRecord("c", 9, GateState.HELD),
        GateRecord("d", 4, GateState.FIRING),
    ]
    assert [g.name for g in closing(gates, 4)] == ["d"]
    assert [g.name for g in closing(gates, 9)] == ["d", "a", "c"]
    assert closing(gates, 2) == []


def test_the_job_holds_at_the_step_until_the_armer_releases(tmp_path: Path) -> None:
    kv = MemoryKV()
    first, second = agent(kv, "n0", tmp_path), agent(kv, "n1", tmp_path)
    armer = GateClient(kv.client(), JOB, "run")
    armer.arm([("step-5", 5)])
    assert first.steps() == second.steps() == (5,)
    first.hold("n0/0", 4)  # before the step: at once

    held = in_thread(first.hold, "n0/0", 5)
    waiting = in_thread(second.hold, "n1/0", 5)
    assert armer.wake.wait(T)
    (claimed,) = armer.ready()
    assert (claimed.step, claimed.actual, claimed.held, claimed.holder) == (5, 5, True, "n0")
    assert record(kv, "run-step-5").node == "n0"
    time.sleep(0.1)
    assert held.is_alive() and waiting.is_alive()  # held while the fault is injected
    armer.release(claimed)
    held.join(T)
    waiting.join(T)
    assert not held.is_alive() and not waiting.is_alive()
    assert record(kv, "run-step-5").state is GateState.RELEASED
    assert first.steps() == ()
    first.hold("n0/0", 5)  # an open gate: at once, also after a rollback to its step
    (event,) = [e for e in read_events(tmp_path) if e["kind"] == "gate-held"]
    assert (event["gate"], event["done"], event["member"]) == ("run-step-5", 5, "n0/0")


def test_a_gate_nobody_claims_is_expired(tmp_path: Path) -> None:
    kv = MemoryKV()
    holds = agent(kv, "n0", tmp_path, hold_timeout=0.2)
    GateClient(kv.client(), JOB, "run").arm([("step-3", 3)])
    started = time.monotonic()
    holds.hold("n0/0", 4)  # armed late: held at the step it got to
    assert time.monotonic() - started < 2.0
    gate = record(kv, "run-step-3")
    assert (gate.state, gate.held_step) == (GateState.EXPIRED, 4)
    assert holds.steps() == ()


def test_an_agent_that_cannot_reach_etcd_does_not_hold(tmp_path: Path) -> None:
    kv = MemoryKV()
    holds = agent(kv, "n0", tmp_path)
    GateClient(kv.client(), JOB, "run").arm([("step-3", 3)])
    holds.kv.set_unavailable(True)  # type: ignore[attr-defined]  # a MemoryKV client
    started = time.monotonic()
    holds.hold("n0/0", 3)
    assert time.monotonic() - started < 1.0


def test_a_gate_the_job_passed_unheld_fires_late(tmp_path: Path) -> None:
    kv = MemoryKV()
    armer = GateClient(kv.client(), JOB, "run")
    armer.arm([("step-3", 3), ("step-8", 8)])
    assert armer.passed(3) == []  # the job may be holding at 3 right now
    (late,) = armer.passed(5)
    assert (late.name, late.step, late.actual, late.held, late.holder) == (
        "run-step-3", 3, 5, False, None
    )  # fmt: skip
    assert armer.passed(5) == []  # claimed once
    armer.release(late)
    assert record(kv, "run-step-3").state is GateState.RELEASED
    assert armer.state("step-8") is GateState.ARMED


def test_two_armers_never_touch_each_others_gates(tmp_path: Path) -> None:
    kv = MemoryKV()
    holds = agent(kv, "n0", tmp_path)
    run, chaos = GateClient(kv.client(), JOB, "run"), GateClient(kv.client(), JOB, "chaos")
    run.arm([("step-4", 4)])
    chaos.arm([("7", 4)])
    held = in_thread(holds.hold, "n0/0", 4)
    assert run.wake.wait(T) and chaos.wake.wait(T)
    (mine,) = run.ready()
    (theirs,) = chaos.ready()
    assert (mine.name, theirs.name) == ("run-step-4", "chaos-7")
    run.release(mine)
    time.sleep(0.1)
    assert held.is_alive()  # the chaos injector's gate still holds the job
    chaos.release(theirs)
    held.join(T)
    assert not held.is_alive()


def requests_of(table: WorkerTable, holds: GateHolds, tmp: Path) -> WorkerRequests:
    """The agent's answers, for hello and hold only (no healer, reports or progress)."""
    events = event_log(tmp / "events-requests.jsonl")
    return WorkerRequests(table, None, None, None, events, lambda _: None, holds)  # type: ignore[arg-type]


def test_hello_pushes_the_closed_steps_and_so_does_every_change(tmp_path: Path) -> None:
    kv = MemoryKV()
    holds = GateHolds(kv.client(), JOB, "n0", event_log(tmp_path / "events-n0.jsonl"), T, T)
    table = WorkerTable(["n0/0"])

    def seen(event: WatchEvent) -> None:  # as NodeAgent._apply
        if holds.apply(event):
            holds.push(table.connections())

    kv.watch_prefix(protocol.prefix(JOB, protocol.GATES), seen)
    armer = GateClient(kv.client(), JOB, "run")
    armer.arm([("step-2", 2), ("step-7", 7)])
    conn = Conn()
    requests = requests_of(table, holds, tmp_path)
    assert requests.handle(conn, Hello("n0/0")) == Ok()  # type: ignore[arg-type]
    assert conn.sent[-1] == GatesPush((2, 7))  # sent before the answer
    armer.arm([("step-9", 9)])  # armed while the worker trains
    assert conn.sent[-1] == GatesPush((2, 7, 9))
    (late,) = armer.passed(3)
    armer.release(late)
    assert conn.sent[-1] == GatesPush((7, 9))


def test_a_worker_controller_holds_at_the_gate_over_its_link(tmp_path: Path) -> None:
    kv = MemoryKV()
    holds = GateHolds(kv.client(), JOB, "n0", event_log(tmp_path / "events-n0.jsonl"), T, T)
    table = WorkerTable(["n0/0"])

    def seen(event: WatchEvent) -> None:  # as NodeAgent._apply
        if holds.apply(event):
            holds.push(table.connections())

    kv.watch_prefix(protocol.prefix(JOB, protocol.GATES), seen)
    requests = requests_of(table, holds, tmp_path)

    def handle(conn: Connection, message: Message) -> object:
        return requests.handle(conn, message)

    address = socket_address(f"gates-{os.getpid()}-{time.monotonic_ns()}", "n0")
    server = LinkServer(address, handle, table.disconnected)  # type: ignore[arg-type]
    armer = GateClient(kv.client(), JOB, "run")
    armer.arm([("step-6", 6)])
    worker = AgentController(address, "n0/0")
    try:
        assert worker.poll(5, announced=False) is None  # before the step: no request
        polled = in_thread(worker.poll, 6, False)
        assert armer.wake.wait(T)
        (claimed,) = armer.ready()
        assert claimed.actual == 6
        time.sleep(0.1)
        assert polled.is_alive()
        armer.release(claimed)
        polled.join(T)
        assert not polled.is_alive()
        started = time.monotonic()
        assert worker.poll(6, announced=False) is None  # passed: no request
        assert time.monotonic() - started < 1.0
    finally:
        worker.close()
        server.close()
