"""`keepstep run` of a transformer stepped as large models are (Muon for the blocks'
matrices, AdamW for the rest), its optimizer state sharded (ZeRO-1), through the loss of a
node: the parameters of one unsharded process, every sample seen once.

Real etcd, real agents; the lost node's chunks come back from their replicas on other
nodes, and Muon's matrices are stepped whole on the members designated for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.launch.local import LocalRun, agreed_sha, run_local

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "transformer.py")
SIZES = ("--muon", "--vocab", "64", "--seq", "16", "--d-model", "32", "--layers", "2")
STEPS, GB, MB = 12, 24, 4

pytestmark = pytest.mark.slow


def test_sharded_muon_through_a_node_loss_keeps_the_numbers(tmp_path: Path) -> None:
    alone = run_local(
        LocalRun(
            script=SCRIPT, steps=STEPS, global_batch=GB, micro_batch=MB, schedule=[["m0"]],
            seed=3, script_args=SIZES, timeout=120.0,
        ),
        tmp_path / "alone",
    )  # fmt: skip
    reference = agreed_sha(alone)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nodes", "3", "--global-batch", str(GB),
        "--micro-batch", str(MB), "--steps", str(STEPS), "--seed", "3", "--run-dir",
        str(run_dir), "--timeout", "140", "--admission-grace", "130", "--shard", "zero1",
        "--fault", "kill-node:1@step=6", "--min-nodes", "2", SCRIPT, *SIZES,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["params_sha256"] == reference
    samples = summary["samples"]
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    assert samples["seen_once"] == samples["expected"] == STEPS * GB
    assert summary["recoveries"][0]["cause"] == "kill-node"
    assert summary["world_size_by_step"][-1] == 2
