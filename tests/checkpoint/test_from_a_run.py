"""Checkpoints written by a real `keepstep run` (two nodes, a checkpoint every 3 steps),
listed and exported: the exported state loads with plain `torch.load(weights_only=True)`
into the examples' fresh objects and hashes to the run summary's params_sha256.

One run of examples/mlp.py and one of examples/scheduled.py (LR schedule, EMA, counter)
per module; the checks then read their checkpoint folders.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from keepstep.elastic.job import Job
from keepstep.elastic.tracked import TrackedState

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
STEPS, EVERY, GB, MB = 6, 3, 16, 4

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Run:
    url: str
    summary: dict[str, Any]
    run_dir: Path


def keepstep_run(where: Path, script: str, etcd: str) -> Run:
    url = f"file://{where}/ckpt"
    argv = ["--nnodes", "2", "--global-batch", str(GB), "--micro-batch", str(MB)]
    argv += ["--steps", str(STEPS), "--seed", "1", "--run-dir", str(where / "run")]
    argv += ["--timeout", "90", "--checkpoint", url, "--checkpoint-every", str(EVERY)]
    proc = subprocess.run(
        [sys.executable, "-m", "keepstep", "run", *argv, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "KEEPSTEP_ETCD_BIN": etcd},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((where / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["params_sha256"]
    return Run(url, summary, where / "run")


@pytest.fixture(scope="module")
def examples() -> Iterator[None]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory, etcd_binary: str) -> Run:
    return keepstep_run(tmp_path_factory.mktemp("mlp"), "mlp.py", etcd_binary)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory: pytest.TempPathFactory, etcd_binary: str) -> Run:
    return keepstep_run(tmp_path_factory.mktemp("scheduled"), "scheduled.py", etcd_binary)


def keepstep(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keepstep", "checkpoint", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def job_sha(model: torch.nn.Module, tracked: TrackedState) -> str:
    """`Job.params_sha256` itself, on a stand-in for the job."""
    sha: str = Job.params_sha256(SimpleNamespace(model=model, tracked=tracked))
    return sha


def test_ls_lists_the_steps_with_the_summarys_hash(mlp: Run) -> None:
    proc = keepstep("ls", "--json", mlp.url)
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    # Step 3, or, on a machine so loaded that the worker went on two steps before its agent
    # read step 3 from the snapshot, the step the agent says it wrote in its place (step 6
    # itself when the worker got that far: then step 6 is listed once).
    log = (mlp.run_dir / "agent-n0.log").read_text()
    late = re.search(r"step 3 left the snapshot before it was read; checkpointing step (\d+)", log)
    first = 3 if late is None else int(late[1])
    steps = [(s["step"], s["status"]) for s in listing["steps"]]
    assert steps == [(s, "intact") for s in sorted({first, 6})], log[-3000:]
    assert listing["newest"] == 6
    assert listing["steps"][-1]["params_sha256"] == mlp.summary["params_sha256"]
    if first != 6:
        assert listing["steps"][0]["params_sha256"] != mlp.summary["params_sha256"]


def test_export_loads_into_a_fresh_model(mlp: Run, tmp_path: Path, examples: None) -> None:
    from mlp import make_model

    out = tmp_path / "mlp.pt"
    proc = keepstep("export", mlp.url, str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: step 6, {out.stat().st_size} B, torch: ")
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == STEPS and saved["state"] == {}
    model = make_model()
    model.load_state_dict(saved["model"])
    assert job_sha(model, TrackedState()) == mlp.summary["params_sha256"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer.load_state_dict(saved["optimizer"])
    assert all(int(s["step"]) == STEPS for s in optimizer.state.values())


def test_tracked_script_state_comes_along(scheduled: Run, tmp_path: Path, examples: None) -> None:
    from mlp import make_model
    from scheduled import Progress, StreamCursor, warmup_cosine

    out = tmp_path / "scheduled.pt"
    proc = keepstep("export", scheduled.url, str(out))
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(out, weights_only=True)
    assert list(saved["state"]) == ["ema", "progress", "cursor", "sched"]  # the script's order
    progress = saved["state"]["progress"]
    assert (progress["steps"], progress["samples"]) == (STEPS, STEPS * GB)
    assert saved["state"]["cursor"]["position"] == STEPS * GB % 1000
    # The script's objects, built as it builds them, loaded from the export.
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    sched = LambdaLR(optimizer, warmup_cosine(max(1, STEPS // 5), STEPS))
    cursor = StreamCursor(length=1000)
    objects = {"ema": ema, "progress": Progress(), "cursor": cursor, "sched": sched}
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    tracked = TrackedState()
    for name, obj in objects.items():
        obj.load_state_dict(saved["state"][name])
        tracked.add(name, obj)
    assert job_sha(model, tracked) == scheduled.summary["params_sha256"]
    assert optimizer.param_groups[0]["lr"] == sched.get_last_lr()[0]
    # Each object's hash, as every worker printed it at the end.
    log = (scheduled.run_dir / "worker-n0-0.log").read_text()
    printed = dict(re.findall(r" (ema|progress|cursor|sched)=([0-9a-f]{64})", log))
    assert saved["state_sha256"] == printed == {n: tracked.sha256(n) for n in objects}
