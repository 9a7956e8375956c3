"""A SIGTERM drains a node whichever of its agent's threads the kernel hands it to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from keepstep.agent.protocol.events import read_events
from thread_signal import signal_other_thread

REPO = Path(__file__).resolve().parents[3]
STEPS = 150

pytestmark = pytest.mark.slow


def start_agents(etcd: str, run_dir: Path) -> list[subprocess.Popen[bytes]]:
    job = f"drain-{uuid.uuid4().hex[:8]}"
    procs = []
    for i, host in enumerate(["127.0.0.1", "127.0.0.2"]):
        env = dict(os.environ, KEEPSTEP_ETCD_ENDPOINTS=etcd, KEEPSTEP_JOB=job)
        env.update(KEEPSTEP_NODE=f"p{i}", KEEPSTEP_HOST=host)
        argv = [sys.executable, "-m", "keepstep", "agent", "--nodes", "2", "--min-nodes", "1"]
        argv += ["--global-batch", "16", "--micro-batch", "4", "--steps", str(STEPS)]
        argv += ["--run-dir", str(run_dir), "--", sys.executable, str(REPO / "examples/mlp.py")]
        with open(run_dir / f"p{i}.log", "ab") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def committed(run_dir: Path) -> int:
    return max((e["step"] for e in read_events(run_dir) if e["kind"] == "commit"), default=-1)


def test_a_sigterm_taken_by_another_thread_drains_the_node_at_once(
    etcd_server: str, tmp_path: Path
) -> None:
    procs = start_agents(etcd_server, tmp_path)
    try:
        deadline = time.monotonic() + 90
        while committed(tmp_path) < 2:
            assert time.monotonic() < deadline, "the job did not start training"
            assert all(p.poll() is None for p in procs), "an agent ended before training"
            time.sleep(0.1)
        sent = time.time()
        signal_other_thread(procs[1].pid, signal.SIGTERM)  # not the agent's main thread
        assert procs[1].wait(timeout=60) == 0  # drained: it left the job, nothing failed
        assert procs[0].wait(timeout=120) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    events = read_events(tmp_path)
    drained = [e for e in events if e["kind"] == "drain-requested"]
    assert [e["node"] for e in drained] == ["p1"]
    assert drained[0]["t"] - sent < 5.0  # not when its worker ended (the bug)
    alone = [e for e in events if e["kind"] == "epoch-agreed" and e["members"] == ["p0/0"]]
    assert alone and alone[0]["planned"]  # a step-boundary drain, not a failure
    finish = {e["member"]: e["done"] for e in events if e["kind"] == "finish"}
    assert finish == {"p0/0": STEPS}  # p1 left before the end; p0 trained every step
