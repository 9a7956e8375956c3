"""`keepstep run --balance` with a node slowed down: fewer micro-batches, the same numbers.

Four nodes train a small MLP whose micro-batches burn a fixed amount of CPU (busy_job.py);
`--fault slow-node:1@step=1:factor=10` holds node n1 (its agent and worker) to a tenth of
a core from step 1 on. With `--balance` the plan follows the measured compute time: the
run must end with the parameters of a fault-free run (one member, and no extra work: the
work touches no parameter), every sample seen once, and, after a weights change at a step
boundary, n1's member planned fewer micro-batches than every other member. The summary's
`micro_batches_by_step` and `weight_changes` say so, and the change's event agrees with
the plan it replaced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.launch.local import LocalRun, agreed_sha, run_local
from keepstep.launch.summary import micro_batches_at

BUSY = str(Path(__file__).resolve().parent / "busy_job.py")
STEPS, GB, MB = 24, 48, 4  # 12 micro-batches: 3 per node when even

pytestmark = pytest.mark.slow


def test_a_slowed_node_gets_fewer_micro_batches_and_the_bits_stay(tmp_path: Path) -> None:
    reference = agreed_sha(
        run_local(
            LocalRun(
                script=BUSY, steps=STEPS, global_batch=GB, micro_batch=MB, schedule=[["m0"]],
                seed=3, script_args=("--work", "0"),
            ),
            tmp_path / "reference",
        )
    )  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nnodes", "4", "--global-batch", str(GB),
        "--micro-batch", str(MB), "--steps", str(STEPS), "--seed", "3", "--run-dir",
        str(run_dir), "--timeout", "230", "--balance",
        "--fault", "slow-node:1@step=1:factor=10", BUSY, "--work", "100",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["params_sha256"] == reference
    assert s["steps"] == STEPS and s["recoveries"] == []
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0
    (fault,) = s["faults"]
    assert fault["kind"] == "slow-node" and fault["step"] == 1 and fault["node"] == "n1"
    assert fault["cpu_share"] == 0.1 and "lifted_t" in fault  # lifted at the end

    spans = s["micro_batches_by_step"]
    assert micro_batches_at(spans, 0) == {f"n{i}/0": 3 for i in range(4)}
    changes = s["weight_changes"]
    assert changes, spans
    first = changes[0]
    assert first["step"] >= 1 and first["new"]["n1/0"] < first["old"]["n1/0"]
    assert first["counts"] == micro_batches_at(spans, first["step"])  # the plan it replaced
    after = micro_batches_at(spans, first["step"] + 1)
    assert after is not None and sum(after.values()) == GB // MB
    others = [n for m, n in after.items() if m != "n1/0"]
    assert after["n1/0"] < min(others), spans
    print(f"replanned after step {first['step']}: {first['counts']} -> {after}")
