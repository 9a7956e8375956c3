"""bench/buffer_sync_cost.py on a tiny model: it runs and reports what it measured.

Values are not checked (they depend on the machine); their presence and shape are, and the
sizes that follow from the model: three buffers per BatchNorm, and one float64 row per
micro-batch of every running mean, variance and counter in the all-reduce.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "buffer_sync_cost.py"


def test_the_bench_reports_the_bookkeeping_beside_the_step() -> None:
    argv = ["--blocks", "1", "--width", "4", "--n-micro", "3", "--image", "8", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[0])
    assert figures["batchnorm_layers"] == 2 and figures["buffers"] == 6
    assert figures["rows_allreduce_bytes"] == 3 * 2 * (4 + 4 + 1) * 8
    assert figures["step_compute_s"] > 0 and figures["buffer_bookkeeping_s"] > 0
