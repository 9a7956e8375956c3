"""A warm spare: ready once it has paid what a cold worker pays before its first step
(torch, torch's compiler front end that a torch optimizer's first call imports, the
library, the reduction's loops), then it runs the worker's script in its place."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from keepstep.agent.node.spare import SparePool

T = 120.0  # a spare imports torch on a loaded machine

SCRIPT = """
import json, os, sys
wanted = ("torch", "torch._dynamo", "keepstep.elastic.api")
report = {"loaded": [m for m in wanted if m in sys.modules], "argv": sys.argv[1:],
          "env": os.environ.get("SPARE_TEST")}
open(sys.argv[1], "w").write(json.dumps(report))
"""


def test_a_spare_has_imported_what_a_worker_needs_and_runs_its_script(tmp_path: Path) -> None:
    ready = threading.Event()
    pool = SparePool(dict(os.environ), tmp_path / "spare.log", lambda pid: ready.set())
    script, out = tmp_path / "worker.py", tmp_path / "report.json"
    script.write_text(SCRIPT)
    try:
        pool.start()
        assert ready.wait(T), (tmp_path / "spare.log").read_text()
        env = {**os.environ, "SPARE_TEST": "yes"}
        proc = pool.take([sys.executable, str(script), str(out)], env, tmp_path / "w.log")
        assert proc is not None
        assert proc.wait(T) == 0, (tmp_path / "w.log").read_text()
    finally:
        pool.close()
    report = out.read_text()
    assert '"loaded": ["torch", "torch._dynamo", "keepstep.elastic.api"]' in report, report
    assert f'"argv": ["{out}"]' in report and '"env": "yes"' in report, report


def test_only_a_python_script_can_use_a_spare(tmp_path: Path) -> None:
    pool = SparePool(dict(os.environ), tmp_path / "spare.log")
    try:
        assert pool.take(["sleep", "1"], {}, tmp_path / "w.log") is None
        assert pool.take([sys.executable, "-m", "mod"], {}, tmp_path / "w.log") is None
    finally:
        pool.close()
