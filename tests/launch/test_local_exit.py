"""The local launcher's members exit with their error when a failure ends the job, not
with SIGABRT from a group-build thread left in a store call (store_exit_job.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "code"), [("keep", -signal.SIGABRT), ("release", 1)])
def test_a_failure_that_ends_the_job_exits_with_the_error(mode: str, code: int) -> None:
    # "keep" checks that the scenario still reproduces the abort the release prevents.
    proc = subprocess.run(
        [sys.executable, str(TESTS / "store_exit_job.py"), "schedule", mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr[-3000:]
    assert "lost given up" in proc.stdout
    if mode == "release":
        assert "PeerLost" in proc.stderr and "given up" in proc.stderr
