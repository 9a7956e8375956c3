"""bench/gpu_check.py on the CPU: every section a CPU can run runs (the gloo processes
with a kill and a rebuild included, and a one-member job trained twice), every check is
true (BatchNorm's buffers kept in step, ZeRO's sharded step too), the JSON has the
fingerprint and the figures, the GPU-only sections are listed as not covered; and the exit
code turns any false check into a failure.

(On a GPU machine: `python3 bench/gpu_check.py`; its JSON goes in the issue note.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_check

REPO = Path(__file__).resolve().parents[2]
CHECKS = {
    "reducer_normal",
    "reducer_overflow_retry",
    "reducer_non_finite",
    "fwd_bwd_repeat",
    "fwd_bwd_history",
    "fwd_bwd_fresh_process",
    "dropout_is_keyed",
    "device_generator_restored",
    "gloo_allreduce_equal",
    "gloo_kill_detected",
    "gloo_rebuild_equal",
    "job_trains",
    "job_fresh_process_equal",
    "buffers_members_agree",
    "buffers_device_mean_is_cpu",
    "zero_threads_equal_unsharded",
    "zero_state_on_device",
    "zero_job_equals_unsharded",
}
GPU_ONLY = ("snapshot_copy", "snapshot_store", "nccl_one_rank")  # listed as not covered


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_cpu_run_passes_every_check() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["device"] == "cpu" and report["errors"] == {}
    assert set(report["checks"]) == CHECKS and all(report["checks"].values())
    assert (
        report["fingerprint"]["device_kind"] == "cpu" and len(report["fingerprint"]["digest"]) == 16
    )
    outcomes = report["details"]["reducer_overflow_retry"]["outcomes"]
    assert outcomes[0].startswith("ReduceOverflow") and outcomes[1:] == ["ReduceDone()"] * 2
    assert report["details"]["reducer_non_finite"]["outcomes"][0].startswith("ReduceNonFinite")
    paths = report["details"]["reducer_normal"]["paths"]
    assert paths["device_default"] == "device-eager" and paths["cpu_tensor_ops"] == "tensor-ops"
    assert report["figures"]["fused_eager_ms_per_1e9"] > 0
    # The gloo section: p2 killed inside a collective, p0 and p1 rebuilt epoch 1 as two.
    assert report["details"]["gloo_kill_rebuild"]["exit_codes"] == {"p0": 0, "p1": 0, "p2": -9}
    assert 0 < report["figures"]["gloo_detect_s"] < 10  # well inside the collective's timeout
    assert report["figures"]["gloo_rebuild_s"] > 0
    # The job section: two fresh processes trained the same six steps to the same bits.
    runs = report["details"]["job_end_to_end"]["runs"]
    assert [r["done"] for r in runs] == [6, 6] and runs[0]["params_device"] == "cpu"
    assert len({r["params_sha256"] for r in runs}) == 1 and report["figures"]["job_step_s"] > 0
    # The ZeRO section: sharded over 1-3 ranks, and a job with shard= on the device.
    cases = report["details"]["zero_on_device"]["threads"]
    assert {c["world"] for c in cases} == {1, 2, 3} and all(c["equal"] for c in cases)
    jobs = report["details"]["zero_on_device"]["jobs"]
    assert [jobs[s]["shard"] for s in ("zero1", "zero2")] == ["zero1", "zero2"]
    assert jobs["none"]["params_sha256"] == runs[0]["params_sha256"]  # the job section's
    not_covered = report["not_covered_here"]
    assert [s.split(" ")[0] for s in not_covered] == list(GPU_ONLY)
    assert all(s.endswith(": needs a CUDA device") for s in not_covered)
    gpu_only = ("snapshot", "pinned", "store", "nccl")
    gpu_figures = [k for k in report["figures"] if k.startswith(gpu_only)]
    assert gpu_figures == []


def test_any_false_check_or_error_fails_the_run() -> None:
    assert gpu_check.exit_code({"a": True, "b": True}, {}) == 0
    assert gpu_check.exit_code({"a": True, "b": False}, {}) == 1
    assert gpu_check.exit_code({"a": True}, {"figures": "Traceback ..."}) == 1
    assert gpu_check.exit_code({}, {}) == 1  # nothing checked is not a pass


def test_cuda_without_a_gpu_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if gpu_check.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--device", "cuda"])
    assert stopped.value.code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
