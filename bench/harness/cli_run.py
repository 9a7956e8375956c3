"""One `keepstep run` from a benchmark script: the command line, and its summary back.

For the scripts that time one thing of keepstep alone (bench/warm_spare.py,
bench/join_time.py); the side-by-side harness has its own runner (run_keepstep.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def keepstep_run(
    flags: Sequence[str], script: Sequence[str], run_dir: Path, timeout: float
) -> dict[str, Any]:
    """`keepstep run FLAGS --run-dir RUN_DIR SCRIPT...` and its summary.json. A failed run
    ends the benchmark with the tail of what it said."""
    argv = [sys.executable, "-m", "keepstep", "run", *flags, "--run-dir", str(run_dir), *script]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SystemExit(f"keepstep run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary
