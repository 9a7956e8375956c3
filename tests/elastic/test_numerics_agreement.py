"""Members whose numerics fingerprints differ: exact mode refuses them before the first
step, naming both; fast mode trains on and says why its numbers may differ (two gloo
members, one reporting another CPU model, or compiling the model: numerics_job.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepstep.launch.local import LocalResult, LocalRun, run_local

SCRIPT = str(Path(__file__).resolve().parent / "numerics_job.py")

pytestmark = pytest.mark.slow


def launch(tmp: Path, mode: str, *args: str) -> LocalResult:
    run = LocalRun(
        script=SCRIPT,
        steps=3,
        global_batch=16,
        micro_batch=4,
        schedule=[["m0", "m1"]],
        mode=mode,
        script_args=("--mode", mode, *args),
        timeout=60.0,
    )
    return run_local(run, tmp)


def test_exact_mode_refuses_members_with_different_numerics(tmp_path: Path) -> None:
    result = launch(tmp_path, "exact", "--other", "m1")
    for member in ("m0", "m1"):
        assert result.returncodes[member] != 0, result.logs[member][-2000:]
        log = result.logs[member]
        assert "NumericsMismatch" in log and "exact mode needs one numerics fingerprint" in log
        assert "Another CPU 9000" in log and "device_name" in log
        assert not result.results.get(member, {}).get("samples")  # no step was trained


def test_fast_mode_trains_on_and_says_why(tmp_path: Path) -> None:
    result = launch(tmp_path, "fast", "--other", "m1")
    for member in ("m0", "m1"):
        assert result.returncodes[member] == 0, result.logs[member][-2000:]
        assert "members differ in numerics" in result.logs[member]
        assert result.results[member]["steps"] == 3


def test_exact_mode_refuses_a_model_compiled_on_some_members_only(tmp_path: Path) -> None:
    """Compiled and eager kernels round differently: refused before the first step, so
    before anything compiles."""
    result = launch(tmp_path, "exact", "--compiled", "m1")
    for member in ("m0", "m1"):
        log = result.logs[member]
        assert result.returncodes[member] != 0, log[-2000:]
        assert "NumericsMismatch" in log and "(2 fingerprints; kernels)" in log, log[-2000:]
        assert "eager model" in log and "compiled model" in log
        assert not result.results.get(member, {}).get("samples")
