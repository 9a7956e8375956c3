"""`keepstep run` with a script that tracks an LR schedule, a GradScaler, an EMA, a
counter and a data cursor: real agents restart a killed worker, admit a joiner, lose a
node and drain one; every member ends with the fault-free run's parameters and state.

The run summary's params_sha256 is every finishing member's hash of the parameters and
the tracked state; it must be one value (the summary says null when members disagree),
equal to the fault-free one-member run's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.agent.protocol.events import read_events
from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "scheduled.py")
STEPS, GB, MB = 28, 48, 4  # steps after the last fault: a late injection still lands
ARGS = ("--grad-scaler",)

pytestmark = pytest.mark.slow


FINAL = re.compile(r"^final steps=\d+ clipped=\d+ params_sha256=\w+ (.*)$", re.M)


def state_hashes(log: str) -> dict[str, str]:
    """name -> hash of each tracked object, from a member's last line (empty: none)."""
    found = FINAL.findall(log)
    return dict(item.split("=", 1) for item in found[-1].split()) if found else {}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> LocalResult:
    run = LocalRun(
        script=SCRIPT,
        steps=STEPS,
        global_batch=GB,
        micro_batch=MB,
        schedule=[["m0"]],
        seed=3,
        script_args=ARGS,
    )
    return run_local(run, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def reference(reference_run: LocalResult) -> str:
    return agreed_sha(reference_run)


def test_tracked_state_survives_every_kind_of_fault(
    reference: str, reference_run: LocalResult, tmp_path: Path
) -> None:
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
        "--admission-grace",  # all four from the first step, however loaded the machine
        "120",
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
    assert {"kill-worker", "kill-node"} <= causes, causes
    assert causes & {"drain-node", "rejoin"}, causes
    # The joiner is admitted in an epoch of its own, or, when its cold start outlasts the
    # four steps to the node loss (a loaded machine), in the epoch after that loss.
    agreed = [e for e in read_events(run_dir) if e["kind"] == "epoch-agreed"]
    admitted = {m for e in agreed for m in e.get("admitted", ())}
    assert "n4/0" in admitted, agreed
    if "join-node" not in causes:
        assert any("n4/0" in e.get("admitted", ()) and e.get("removed") for e in agreed), agreed
    # 4 nodes; the restarted worker is back, one node is lost, one joins, one drains.
    sizes = summary["world_size_by_step"]
    assert sizes[0] == 4 and sizes[-1] == 3, sizes
    # Each kind of state on its own, on every member that trained to the end (the drained
    # and the killed node's members left before it): the same as the fault-free run's.
    expected = state_hashes(reference_run.logs["m0"])
    assert set(expected) == {"ema", "progress", "cursor", "sched", "grad_scaler"}, expected
    finals = {
        log.name: hashes
        for log in sorted(run_dir.glob("worker-*.log"))
        if (hashes := state_hashes(log.read_text(errors="replace")))
    }
    assert len(finals) == 3 and all(h == expected for h in finals.values()), finals
