"""Heartbeats between ring neighbours: who watches whom, when silence makes a node lost,
and that a watcher that was itself stopped blames nobody."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keepstep.agent.node.agreement import suspects
from keepstep.agent.node.heartbeat import HeartbeatMonitor, Silence, neighbours
from keepstep.agent.node.probe import ProbeResult, ProbeServer
from keepstep.agent.protocol import EpochRecord, NodeRecord

ATTEMPT = 0.2
INTERVAL = 0.1


def ok(node: str) -> ProbeResult:
    return ProbeResult(node, True, seconds=0.01)


def hung(node: str) -> ProbeResult:
    return ProbeResult(node, False, detail="no answer", seconds=ATTEMPT, timed_out=True)


class Clock:
    """Drives `Silence.round` the way the monitor's loop does: wait, probe, fold."""

    def __init__(self, silence: Silence) -> None:
        self.silence, self.now = silence, 100.0

    def round(
        self, results: dict[str, ProbeResult], epoch: int = 1, scale: float = 1.0, pause: float = 0
    ) -> list[tuple[str, float]]:
        self.now += INTERVAL + pause
        started = self.now
        self.now += max(r.seconds for r in results.values())
        return self.silence.round(started, self.now, results, epoch, scale, ATTEMPT, INTERVAL)


def test_each_node_watches_its_two_ring_neighbours() -> None:
    assert neighbours("n1", ["n0", "n1", "n2", "n3"]) == ("n0", "n2")
    assert neighbours("n0", ["n3", "n0", "n1", "n2"]) == ("n1", "n3")
    assert neighbours("n0", ["n0", "n1"]) == ("n1",)
    assert neighbours("n0", ["n0"]) == ()
    assert neighbours("n9", ["n0", "n1"]) == ()


@given(st.sets(st.integers(0, 999), min_size=2, max_size=60))
def test_every_node_has_a_watcher_and_nobody_watches_itself(ids: set[int]) -> None:
    nodes = [f"n{i}" for i in ids]
    watchers: dict[str, set[str]] = {n: set() for n in nodes}
    for me in nodes:
        watched = neighbours(me, nodes)
        assert me not in watched and 1 <= len(watched) <= 2
        for other in watched:
            watchers[other].add(me)
    assert all(len(w) == min(2, len(nodes) - 1) for w in watchers.values())


def test_a_node_silent_for_the_bound_is_reported_once_per_epoch() -> None:
    clock = Clock(Silence(bound=0.5, stall=0.25))
    assert clock.round({"n1": ok("n1"), "n2": ok("n2")}) == []
    lost: list[tuple[str, float]] = []
    rounds = 0
    while not lost:
        lost = clock.round({"n1": hung("n1"), "n2": ok("n2")})
        rounds += 1
    ((node, silent),) = lost
    assert node == "n1" and 0.5 <= silent < 0.5 + ATTEMPT + INTERVAL
    assert rounds == 2  # two attempts of 0.2 s, with 0.1 s between
    assert clock.silence.silent(clock.now, 1.0) == ["n1"]
    assert clock.round({"n1": hung("n1"), "n2": ok("n2")}) == []  # once per epoch
    assert [n for n, _ in clock.round({"n1": hung("n1")}, epoch=2)] == ["n1"]


def test_an_answer_resets_the_silence() -> None:
    clock = Clock(Silence(bound=0.5, stall=0.25))
    for _ in range(20):  # a node that misses every other heartbeat is slow, not lost
        assert clock.round({"n1": hung("n1")}) == []
        assert clock.round({"n1": ok("n1")}) == []
    assert clock.silence.silent(clock.now, 1.0) == []


def test_the_epochs_timeout_scale_stretches_the_bound() -> None:
    clock = Clock(Silence(bound=0.5, stall=0.25))
    clock.round({"n1": ok("n1")}, scale=4.0)
    silent_rounds = 0
    while not clock.round({"n1": hung("n1")}, scale=4.0):
        silent_rounds += 1
    assert silent_rounds * (ATTEMPT + INTERVAL) >= 1.5  # 2 s at 4x, not 0.5 s


def test_a_watcher_that_was_stopped_blames_nobody() -> None:
    clock = Clock(Silence(bound=0.5, stall=0.25))
    clock.round({"n1": ok("n1")})
    # The watcher was stopped for 3 s between two rounds; its first probe after that
    # times out too (the peer's answer was lost with it).
    assert clock.round({"n1": hung("n1")}, pause=3.0) == []
    # A round that took far longer than one attempt: the watcher stalled inside it.
    clock.now += INTERVAL
    started = clock.now
    clock.now += 2.0
    assert clock.silence.round(started, clock.now, {"n1": hung("n1")}, 1, 1.0, ATTEMPT, 0.1) == []
    # Counting starts again: a node really hung from now on is reported after the bound.
    lost = []
    while not lost:
        lost = clock.round({"n1": hung("n1")})
    assert lost[0][1] >= 0.5


def test_a_node_no_longer_watched_starts_afresh() -> None:
    clock = Clock(Silence(bound=0.5, stall=0.25))
    clock.round({"n1": hung("n1"), "n2": ok("n2")})
    clock.round({"n2": ok("n2")})  # n1 left the ring
    assert "n1" not in clock.silence.last_ok
    assert clock.round({"n1": hung("n1"), "n2": ok("n2")}) == []


def test_silent_nodes_skip_the_second_probe() -> None:
    probes = {"n1": hung("n1"), "n2": hung("n2"), "n3": ok("n3")}
    assert suspects(probes) == ["n1", "n2"]
    assert suspects(probes, frozenset({"n1"})) == ["n2"]


def epoch_of(nodes: list[str], scale: float = 1.0) -> EpochRecord:
    return EpochRecord(1, [f"{n}/0" for n in nodes], "", 0, 0.0, timeout_scale=scale)


def test_the_monitor_finds_a_stopped_process_and_not_a_live_one() -> None:
    """A real probe server in a child process, stopped with SIGSTOP: the kernel still
    accepts its connections, nobody answers."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from keepstep.agent.node.probe import ProbeServer\n"
            "s = ProbeServer(lambda: {'ready': []})\n"
            "print(s.port, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        live = ProbeServer(lambda: {"ready": []})
        nodes = {
            "n1": NodeRecord("n1", "127.0.0.1", live.port, 1),
            "n2": NodeRecord("n2", "127.0.0.1", port, child.pid),
        }
        epoch = epoch_of(["n0", "n1", "n2"])
        lost: list[tuple[str, float, float]] = []
        found = threading.Event()

        def on_lost(record: EpochRecord, node: str, silent: float) -> None:
            lost.append((node, silent, time.monotonic()))
            found.set()

        monitor = HeartbeatMonitor("n0", lambda: (epoch, nodes), on_lost, 0.5, INTERVAL)
        monitor.start()
        try:
            time.sleep(0.6)
            assert lost == [] and monitor.silent_nodes() == frozenset()
            os.kill(child.pid, signal.SIGSTOP)
            assert found.wait(10.0), "the stopped node was never reported"
            ((node, silent, _),) = lost
            assert node == "n2" and silent >= 0.5
            assert monitor.silent_nodes() == frozenset({"n2"})
        finally:
            monitor.close()
            live.close()
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


def test_a_refused_connection_counts_as_silence() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]  # closed when the block ends: connections refused
    found = threading.Event()
    nodes = {"n1": NodeRecord("n1", "127.0.0.1", port, 1)}
    monitor = HeartbeatMonitor(
        "n0", lambda: (epoch_of(["n0", "n1"]), nodes), lambda *_: found.set(), 0.3, INTERVAL
    )
    monitor.start()
    try:
        assert found.wait(10.0)
    finally:
        monitor.close()


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="bound=0"):
        HeartbeatMonitor("n0", lambda: (None, {}), lambda *_: None, 0, 0.1)
