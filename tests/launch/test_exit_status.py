"""`keepstep run`'s verdict: every agent's exit status counts, in the exit status and in
the summary's `failures`.

- Unit: a run that trained every step with agreeing workers still fails when an agent
  exited non-zero, unless a kill-node or hang-node fault ended that agent on purpose.
- End to end: a run whose durable checkpoints cannot be written (the URL lies under a
  regular file) trains to the end, and fails, naming the agent and why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keepstep.launch.summary import run_failures

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


def summary(steps: int = 10, sha: str | None = SHA, disagree: list[str] | None = None) -> Any:
    return {"steps": steps, "params_sha256": sha, "params_sha256_disagree": disagree or []}


def test_a_clean_run_has_no_failures() -> None:
    assert run_failures(summary(), steps=10, agent_exits={"n0": 0, "n1": 0}) == []


def test_an_agent_that_exited_non_zero_fails_the_run_with_its_reason() -> None:
    failures = run_failures(
        summary(),
        steps=10,
        agent_exits={"n0": 1, "n1": 0, "n2": -6, "n3": None},
        agent_reasons={"n0": "durable checkpoint failed: step 10"},
    )
    assert failures == [
        "agent n0 exited with code 1: durable checkpoint failed: step 10",
        "agent n2 exited with signal SIGABRT",
        "agent n3 did not exit",
    ]


def test_nodes_a_fault_ended_may_exit_by_its_signal() -> None:
    faults = [
        {"kind": "kill-node", "node": "n1", "t": 1.0},
        {"kind": "hang-node", "node": "n2", "t": 2.0},
        {"kind": "kill-node", "node": "n3"},  # skipped: never applied
        {"kind": "drain-node", "node": "n4", "t": 3.0},
    ]
    exits = {"n0": 0, "n1": -9, "n2": -9, "n3": -9, "n4": 1}
    failures = run_failures(summary(), steps=10, agent_exits=exits, faults=faults)
    assert failures == ["agent n3 exited with signal SIGKILL", "agent n4 exited with code 1"]


def test_missing_steps_and_disagreeing_workers_fail_the_run() -> None:
    assert run_failures(summary(steps=7, sha=None), steps=10, agent_exits={"n0": 0}) == [
        "the job trained 7 of 10 steps",
        "no worker reported its final parameters",
    ]
    # No worker finished (a script that raised at step 8): the steps committed are named.
    died = {**summary(steps=0, sha=None), "committed_steps": 8}
    assert run_failures(died, steps=10, agent_exits={"n0": 1}) == [
        "the job committed 8 of 10 steps; no worker finished",
        "no worker reported its final parameters",
        "agent n0 exited with code 1",
    ]
    disagree = summary(sha=None, disagree=["a", "b"])
    assert run_failures(disagree, steps=10, agent_exits={}) == [
        "the workers finished with 2 different parameter digests"
    ]


@pytest.mark.slow
def test_a_failed_durable_checkpoint_fails_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory would go\n")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nodes", "2", "--global-batch", "8",
        "--micro-batch", "4", "--steps", "4", "--seed", "1", "--run-dir", str(run_dir),
        "--timeout", "100", "--checkpoint", f"file://{blocker}/ckpt",
        str(REPO / "examples" / "mlp.py"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 4 and s["params_sha256"] is not None  # training itself succeeded
    # The epoch's first member's agent (n0's) writes the checkpoints: it fails, and says why.
    assert s["agent_exit_codes"] == {"n0": 1, "n1": 0}
    (failure,) = s["failures"]
    assert failure.startswith("agent n0 exited with code 1: durable checkpoint failed"), failure
    assert "keepstep: agent n0 exited with code 1: durable checkpoint failed" in proc.stderr
