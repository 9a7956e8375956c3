"""Bad input to `keepstep run` and the agent: a clear error, a non-zero exit, no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keepstep.agent.node.config import AgentConfig, dump_config

pytestmark = pytest.mark.slow


def keepstep(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keepstep", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_a_script_that_raises_fails_the_run_and_shows_why(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('the model file is missing')\n")
    start = time.monotonic()
    proc = keepstep(
        "run",
        "--nodes",
        "2",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "3",
        "--run-dir",
        str(tmp_path / "run"),
        str(script),
    )
    assert proc.returncode == 1
    assert "did not finish cleanly" in proc.stderr
    assert "RuntimeError: the model file is missing" in proc.stderr
    assert time.monotonic() - start < 80


def test_a_missing_script_is_named(tmp_path: Path) -> None:
    proc = keepstep(
        "run",
        "--nodes",
        "1",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "3",
        str(tmp_path / "nope.py"),
    )
    assert proc.returncode == 2
    assert "nope.py' does not exist" in proc.stderr


def test_an_etcd_binary_that_does_not_exist_is_named(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("")
    env = dict(os.environ, KEEPSTEP_ETCD_BIN=str(tmp_path / "no-etcd"))
    proc = keepstep(
        "run",
        "--nodes",
        "1",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "3",
        str(script),
        env=env,
    )
    assert proc.returncode == 2
    assert "KEEPSTEP_ETCD_BIN" in proc.stderr


def test_an_agent_whose_etcd_is_unreachable_gives_up_with_a_clear_error(tmp_path: Path) -> None:
    cfg = AgentConfig(
        job="j",
        node="n0",
        etcd="127.0.0.1:9",
        script=str(tmp_path / "x.py"),
        run_dir=tmp_path,
        op_timeout=1.0,
    )
    dump_config(cfg, tmp_path / "agent.json")
    start = time.monotonic()
    proc = keepstep("agent", "--config", str(tmp_path / "agent.json"), timeout=60)
    assert proc.returncode != 0
    assert "keepstep: error:" in proc.stderr
    assert time.monotonic() - start < 30
    assert json.loads((tmp_path / "agent.json").read_text())["etcd"] == "127.0.0.1:9"
