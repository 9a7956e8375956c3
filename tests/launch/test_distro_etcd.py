"""`keepstep run` on the etcd a distribution ships (Debian 12's `etcd-server` is 3.4.23).

The binary is found as a user's would be: `etcd` on PATH, with KEEPSTEP_ETCD_BIN unset and
no build of ours in the cache. Skipped, with the reason, where the package is not
installed; scripts/test installs it, so CI runs this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.launch.etcd_binary import BIN_ENV, MIN_VERSION, OLD_BIN_ENV, etcd_version, find_etcd

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
DISTRO_ETCD = Path("/usr/bin/etcd")  # where Debian's and Ubuntu's etcd-server put it
STEPS, GB, MB = 16, 16, 4

pytestmark = pytest.mark.slow


def distro_etcd() -> tuple[int, int, int]:
    """The version of the distribution's etcd; skips the test where there is none."""
    if not DISTRO_ETCD.is_file():
        pytest.skip(
            f"no distribution etcd at {DISTRO_ETCD} (Debian, Ubuntu: apt-get install "
            "etcd-server; scripts/test installs it)"
        )
    version = etcd_version(str(DISTRO_ETCD))
    if version is None:
        pytest.skip(f"{DISTRO_ETCD} --version names no etcd version: not etcd-server's binary")
    return version


def test_a_job_recovers_from_a_worker_kill_on_the_distribution_etcd(tmp_path: Path) -> None:
    version = distro_etcd()
    assert version >= MIN_VERSION  # what a user installs must be enough
    env = {k: v for k, v in os.environ.items() if k not in (BIN_ENV, OLD_BIN_ENV)}
    env["PATH"] = os.pathsep.join([str(DISTRO_ETCD.parent), env.get("PATH", os.defpath)])
    env["KEEPSTEP_CACHE"] = str(tmp_path / "cache")  # no build of ours to fall back on
    assert find_etcd(env) == str(DISTRO_ETCD)  # what `keepstep run` starts below
    run_dir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "keepstep", "run", "--nodes", "2", "--global-batch", str(GB),
         "--micro-batch", str(MB), "--steps", str(STEPS), "--seed", "3",
         "--fault", "kill-worker:1@step=6", "--run-dir", str(run_dir), "--timeout", "100",
         MLP, "--sleep", "0.05"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shown = ".".join(map(str, version))
    assert run.returncode == 0, f"etcd {shown}:\n{run.stdout}{run.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["params_sha256"] and summary["params_sha256_disagree"] == []
    (recovery,) = summary["recoveries"]
    assert recovery["cause"] == "kill-worker" and recovery["mttr_s"] is not None
    samples = summary["samples"]
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    assert samples["seen_once"] == samples["expected"] == STEPS * GB
