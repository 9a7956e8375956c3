"""Durable checkpoints: a whole job stopped at step 12 and resumed ends with the numbers
of a job that never stopped, from file:// and from a real S3 endpoint (moto on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from keepstep.agent.durable.writer import list_checkpoints
from keepstep.launch.local import LocalRun, agreed_sha, run_local
from s3server import KEY, REGION, SECRET, S3Server

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
GB, MB, FIRST, TOTAL = 48, 4, 12, 20
BUCKET = "keepstep-resume"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server.start(timeout=60)
    try:
        fsspec.filesystem("s3", **server.storage_options()).mkdir(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    run = LocalRun(
        script=MLP, steps=TOTAL, global_batch=GB, micro_batch=MB, schedule=[["m0"]], seed=5
    )
    return agreed_sha(run_local(run, tmp_path_factory.mktemp("ref")))


def run(
    run_dir: Path,
    steps: int,
    env: dict[str, str],
    *args: str,
    nodes: int = 2,
    script_args: tuple[str, ...] = (),
) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "keepstep",
        "run",
        "--nodes",
        str(nodes),
        "--global-batch",
        str(GB),
        "--micro-batch",
        str(MB),
        "--steps",
        str(steps),
        "--seed",
        "5",
        "--run-dir",
        str(run_dir),
        "--timeout",
        "90",
        *args,
        MLP,
        *script_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary: dict[str, object] = json.loads((run_dir / "summary.json").read_text())
    return summary


@pytest.mark.parametrize("where", ["file", "s3"])
def test_resume_from_a_durable_checkpoint(
    where: str, reference: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = dict(os.environ)
    options: dict[str, object] = {}
    if where == "file":
        url = f"file://{tmp_path}/ckpt"
    else:
        server: S3Server = request.getfixturevalue("s3")
        url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        env.update(
            AWS_ACCESS_KEY_ID=KEY,
            AWS_SECRET_ACCESS_KEY=SECRET,
            AWS_DEFAULT_REGION=REGION,
            KEEPSTEP_S3_ENDPOINT=server.endpoint,
        )
        options = server.storage_options()
    # Steps of ~0.3 s (--sleep only waits): on a loaded machine, steps of milliseconds let
    # the last snapshot replace every pending write before the writer's thread ran, and
    # the checkpoint of step 12 was the only one.
    first = run(tmp_path / "a", FIRST, env, "--checkpoint", url, "--checkpoint-every", "5",
                script_args=("--sleep", "0.05"))  # fmt: skip
    assert first["steps"] == FIRST
    steps = [c.step for c in list_checkpoints(url, 30.0, options)]
    # Due every 5 steps and at the last; a slow store may skip one or take it late (the
    # newest snapshot replaces a pending write: step 7 for the one due at 5 on a loaded
    # machine), and keep=2 prunes the rest.
    assert steps[-1] == FIRST and len(steps) == 2 and 5 <= steps[0] < FIRST, steps
    second = run(tmp_path / "b", TOTAL, env, "--resume", url)
    assert second["params_sha256"] == reference
    assert second["start_step"] == FIRST
    samples = second["samples"]
    assert isinstance(samples, dict)
    assert samples["lost"] == 0 and samples["duplicated"] == 0
    assert samples["expected"] == (TOTAL - FIRST) * GB


def test_a_sharded_job_resumes_on_another_world_size(reference: str, tmp_path: Path) -> None:
    """ZeRO-1 on three nodes writes each member's part every 6 steps; two nodes resume from
    the parts joined and end with the numbers of the unsharded job that never stopped."""
    url = f"file://{tmp_path}/ckpt"
    env = dict(os.environ)
    shard = ("--shard", "zero1")
    first = run(tmp_path / "a", FIRST, env, *shard, "--checkpoint", url, "--checkpoint-every", "6",
                nodes=3)  # fmt: skip
    assert first["steps"] == FIRST
    (latest,) = [c for c in list_checkpoints(url, 30.0) if c.step == FIRST]
    assert latest.parts == 3
    parts = sorted(p.name for p in (tmp_path / "ckpt").glob(f"step-{FIRST:08d}.*.part-*.ckpt"))
    assert [p.rsplit(".part-", 1)[1] for p in parts] == [f"000{i}-of-0003.ckpt" for i in range(3)]
    # `keepstep checkpoint` reads the parts joined; the optimizer state it cannot export.
    tool = [sys.executable, "-m", "keepstep", "checkpoint"]
    listed = subprocess.run([*tool, "ls", "--json", url], capture_output=True, text=True,
                            timeout=60, check=True)  # fmt: skip
    steps = {s["step"]: s for s in json.loads(listed.stdout)["steps"]}
    assert steps[FIRST]["status"] == "intact"
    assert steps[FIRST]["params_sha256"] == first["params_sha256"]
    out = tmp_path / "state.pt"
    refused = subprocess.run([*tool, "export", url, str(out)], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "sharded job's checkpoint (3 parts)" in refused.stderr
    second = run(tmp_path / "b", TOTAL, env, *shard, "--resume", url, nodes=2)
    assert second["params_sha256"] == reference
    assert second["start_step"] == FIRST
    samples = second["samples"]
    assert isinstance(samples, dict)
    assert samples["lost"] == 0 and samples["duplicated"] == 0


def test_resume_from_an_empty_location_is_refused(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "keepstep",
        "run",
        "--nodes",
        "1",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--steps",
        "4",
        "--run-dir",
        str(tmp_path / "r"),
        "--resume",
        f"file://{tmp_path}/nothing",
        MLP,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no checkpoint there" in proc.stderr
