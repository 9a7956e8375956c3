"""keepstep: the workload under `keepstep run`, the faults injected by keepstep's launcher.

`keepstep run --nodes N --min-nodes M ... --fault SPEC ... bench/keepstep_job.py ...`
with the schedule's faults in their `--fault` form; the launcher writes `faults.json`
(each with its wall time) and `summary.json` (the run summary contract: params_sha256,
world size by step, recoveries with phases, the sample ledger), kept in `extra`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from harness.procs import RunFailed
from harness.runs import BENCH, Run, RunResult, job_env
from harness.steplog import read_records


def run_keepstep(run: Run) -> RunResult:
    cfg, w = run.cfg, run.cfg.workload
    run.folder.mkdir(parents=True, exist_ok=True)
    run_dir, summary_path = run.folder / "run", run.folder / "summary.json"
    argv = [
        sys.executable, "-m", "keepstep", "run",
        "--nodes", str(cfg.nodes), "--min-nodes", str(cfg.min_nodes),
        "--global-batch", str(w.global_batch), "--micro-batch", str(w.micro_batch),
        "--steps", str(w.steps), "--seed", str(w.seed),
        "--hang-timeout", str(int(cfg.detect_timeout_s)),
        "--run-dir", str(run_dir), "--summary", str(summary_path),
        "--timeout", str(cfg.run_timeout_s),
    ]  # fmt: skip
    for fault in run.faults:
        argv += ["--fault", fault.spec()]
    argv += [str(BENCH / "keepstep_job.py"), *w.flags()]
    argv += ["--log-dir", str(run.log_dir), "--save", str(run.params)]
    result = RunResult(run.system, faulty=bool(run.faults))
    t0 = time.monotonic()
    try:
        with open(run.folder / "keepstep.log", "wb") as out:
            done = subprocess.run(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=job_env(dict(os.environ)),
                timeout=cfg.run_timeout_s + 60,
                check=False,
            )
        if done.returncode != 0:
            tail = (run.folder / "keepstep.log").read_text(errors="replace")[-800:]
            raise RunFailed(f"keepstep run exited with {done.returncode}: ...{tail}")
        result.params = run.params
    except (RunFailed, subprocess.TimeoutExpired) as error:
        result.error = str(error)
    finally:
        result.wall_s = time.monotonic() - t0
        result.records = read_records(run.log_dir) if run.log_dir.is_dir() else []
    if summary_path.is_file():
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        result.extra["summary"] = summary
    faults_path = run_dir / "faults.json"
    if faults_path.is_file():
        for f in json.loads(faults_path.read_text()):
            node = str(f["node"]).removeprefix("n")
            result.faults.append(
                {
                    "kind": f["kind"],
                    "node": int(node) if node.isdigit() else None,
                    "step": int(f["spec"].rpartition("=")[2]),
                    "at_step": f["step"],
                    "t": f["t"],
                    "spec": f["spec"],
                    "note": f"keepstep's launcher, on {f['node']}",
                }
            )
    done_specs = {f["spec"] for f in result.faults}
    skipped = [f.spec() for f in run.faults if f.spec() not in done_specs]
    if skipped:
        result.extra["faults_not_injected"] = skipped
    return result
