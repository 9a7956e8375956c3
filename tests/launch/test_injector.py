"""The launcher's fault injector on an in-memory etcd, with `sleep` processes for nodes.

- The step's faults are injected while an agent holds the gate, and logged with their
  scheduled step, the step they landed at and `held`; the hold ends after them.
- A gate the job passed unheld fires late, when the launcher sees the job past it.
- Without gates (etcd refused them), faults land when their step is seen.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv import MemoryKV, WatchEvent
from keepstep.agent.node.gates import GateHolds
from keepstep.agent.protocol import NodeRecord
from keepstep.agent.protocol.events import EventLog
from keepstep.launch.faults import parse_fault
from keepstep.launch.injector import FaultInjector

JOB, T = "inject", 5.0


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(T)


def sleeper(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    procs.append(proc)
    return proc


def injector(
    faults: list[str], procs: list[subprocess.Popen[bytes]], started: list[str]
) -> FaultInjector:
    agents = {"n0": sleeper(procs)}
    return FaultInjector(
        [parse_fault(f) for f in faults], 1, agents, started.append, set(), lambda _: None
    )


def test_faults_land_while_the_job_is_held_at_their_step(
    procs: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    kv, started = MemoryKV(), []
    worker = sleeper(procs)
    kv.put(
        protocol.key(JOB, "nodes", "n0"),
        protocol.encode(NodeRecord("n0", "127.0.0.1", 1, 1, {"n0/0": worker.pid})),
        T,
    )
    faults = injector(
        ["kill-worker:0@step=3", "join-node@step=3", "drain-node:0@step=7"], procs, started
    )
    faults.arm(kv, JOB)
    events = EventLog(tmp_path / "events-n0.jsonl")
    holds = GateHolds(kv.client(), JOB, "n0", events, T)

    def seen(event: WatchEvent) -> None:
        holds.apply(event)

    kv.watch_prefix(protocol.prefix(JOB, protocol.GATES), seen)
    for item in kv.get_prefix(protocol.prefix(JOB, protocol.GATES), T):  # as the agent starts
        seen(WatchEvent("put", item.key, item.value, item.mod_revision))
    try:
        held = threading.Thread(target=holds.hold, args=("n0/0", 3), daemon=True)
        held.start()
        assert faults.wake is not None and faults.wake.wait(T)
        faults.on_held()
        held.join(T)
        assert not held.is_alive()
        assert worker.wait(T) == -9 and started == ["n1"]
        assert [(f["spec"], f["scheduled_step"], f["step"], f["held"]) for f in faults.log] == [
            ("kill-worker:0@step=3", 3, 3, True),
            ("join-node@step=3", 3, 3, True),
        ]
        faults.on_progress(7)  # the job may be holding at 7 now: not passed yet
        assert len(faults.log) == 2 and faults.next_step() == 7
        faults.on_progress(9)  # passed unheld: late
        assert faults.log[-1]["step"] == 9 and faults.log[-1]["held"] is False
        assert faults.agents["n0"].wait(T) == -15  # SIGTERM: the drain
        assert faults.next_step() is None
    finally:
        faults.close()
        events.close()


def test_without_gates_faults_land_when_their_step_is_seen(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    kv, started = MemoryKV(), []
    faults = injector(["join-node@step=2"], procs, started)
    kv.set_unavailable(True)
    faults.arm(kv, JOB)
    assert faults.wake is None
    faults.on_progress(1)
    assert started == []
    faults.on_progress(4)
    assert started == ["n1"]
    (logged,) = faults.log
    assert (logged["scheduled_step"], logged["step"], logged["held"]) == (2, 4, False)


def test_a_held_fault_waits_for_the_checkpoint_due_by_its_step(
    procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpoints every 4 steps; a fault held at step 10 lands after step 8's is published,
    # however long the agents' background writes take on a loaded machine.
    answers = iter([-1, 4, 4, 8])
    asked: list[int] = []

    def published() -> int:
        asked.append(next(answers, 8))
        return asked[-1]

    notes: list[str] = []
    faults = FaultInjector(
        [parse_fault("kill-node:0@step=10")], 1, {"n0": sleeper(procs)}, print, set(),
        notes.append, published, 4,
    )  # fmt: skip
    faults._await_checkpoint(10)
    assert asked == [-1, 4, 4, 8] and notes == []
    faults._await_checkpoint(3)  # none due yet
    assert len(asked) == 4
    # One that never comes is waited for only so long, and said.
    monkeypatch.setattr("keepstep.launch.injector.CHECKPOINT_WAIT_S", 0.3)
    stuck = FaultInjector([], 1, {}, print, set(), notes.append, lambda: 4, 4)
    stuck._await_checkpoint(8)
    assert notes == ["the checkpoint of step 8 was not published within 0.3 s: the faults of "
                     "step 8 land without it"]  # fmt: skip
    # Without checkpoints nothing is awaited.
    FaultInjector([], 1, {}, print, set(), notes.append)._await_checkpoint(8)
    assert len(notes) == 1
