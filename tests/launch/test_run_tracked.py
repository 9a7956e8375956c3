"""`keepstep run` with a script that tracks an LR schedule, a GradScaler, an EMA and a
counter: real agents restart a killed worker, admit a joiner, lose a node and drain one.

The run summary's params_sha256 is every finishing member's hash of the parameters and
the tracked state; it must be one value (the summary says null when members disagree),
equal to the fault-free one-member run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.launch.local import LocalRun, agreed_sha, run_local

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "scheduled.py")
STEPS, GB, MB = 28, 48, 4  # steps after the last fault: a late injection still lands
ARGS = ("--grad-scaler",)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = LocalRun(
        script=SCRIPT,
        steps=STEPS,
        global_batch=GB,
        micro_batch=MB,
        schedule=[["m0"]],
        seed=3,
        script_args=ARGS,
    )
    return agreed_sha(run_local(run, tmp_path_factory.mktemp("reference")))


def test_tracked_state_survives_every_kind_of_fault(reference: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    faults = ["kill-worker:1@step=4", "join-node@step=8", "kill-node:2@step=12"]
    faults += ["drain-node:3@step=16"]
    cmd = [
        sys.executable,
        "-m",
        "keepstep",
        "run",
        "--nodes",
        "4",
        "--min-nodes",
        "2",
        "--global-batch",
        str(GB),
        "--micro-batch",
        str(MB),
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--run-dir",
        str(run_dir),
        "--timeout",
        "140",
        *(arg for fault in faults for arg in ("--fault", fault)),
        SCRIPT,
        *ARGS,
        # Slow steps leave the joining node time to start and be admitted.
        "--sleep",
        "0.2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["params_sha256_disagree"] == []
    assert summary["params_sha256"] == reference
    assert summary["steps"] == STEPS
    samples = summary["samples"]
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    causes = {r["cause"] for r in summary["recoveries"]}
    # The drain is seen in the sizes below (the last world is 3 only if it left); its
    # epoch can also admit the restarted worker back, and is then labelled a rejoin.
    assert {"kill-worker", "join-node", "kill-node"} <= causes, causes
    assert causes & {"drain-node", "rejoin"}, causes
    # 4 nodes; the restarted worker is back, one node is lost, one joins, one drains.
    sizes = summary["world_size_by_step"]
    assert sizes[0] == 4 and sizes[-1] == 3, sizes
