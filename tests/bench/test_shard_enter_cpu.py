"""bench/shard_enter_cpu.py on a tiny model: the replayed enter is the one it stands for.

The bench times one member's ZeRO-1 enter alone by replaying the answers its collectives
got when every member entered together; it refuses to print figures if the replay
received other bytes than the joint enter did. Values are not checked (they depend on
the machine); their presence and shape are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "shard_enter_cpu.py"


def test_the_replayed_enter_receives_what_the_joint_one_did() -> None:
    argv = ["--nodes", "4", "--rounds", "2", "--d-model", "16", "--layers", "1", "--vocab", "32"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[0])
    assert figures["survivors"] == 3 and figures["chunks"] == 128  # 32 a member: small
    assert figures["received_bytes"] > 0  # n1's chunks and replicas had to move
    assert len(figures["enter_cpu_ms"]) == 2 and figures["enter_cpu_ms_median"] > 0
    # --chunks raises the count (a large model's), and the replay still holds.
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv, "--chunks", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[0])["chunks"] == 1024


def test_too_few_nodes_are_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--nodes", "2"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--nodes 2 must be >= 3" in done.stderr
