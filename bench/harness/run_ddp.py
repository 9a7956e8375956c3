"""The speed reference: plain DistributedDataParallel on `nodes` processes, no faults.

Starts bench/ddp_job.py once per rank with the usual RANK / WORLD_SIZE / MASTER_*
variables (what any launcher sets) and waits for all of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from harness.procs import RunFailed, free_port, stop_groups, wait_for
from harness.runs import BENCH, Run, RunResult, job_env
from harness.steplog import read_records


def run_ddp(run: Run) -> RunResult:
    if run.faults:
        raise ValueError("plain DDP is the fault-free reference; it takes no faults")
    cfg = run.cfg
    run.folder.mkdir(parents=True, exist_ok=True)
    result = RunResult(run.system, faulty=False)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        for rank in range(cfg.nodes):
            env = job_env(
                dict(
                    os.environ,
                    RANK=str(rank),
                    LOCAL_RANK="0",
                    WORLD_SIZE=str(cfg.nodes),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
            )
            argv = [sys.executable, str(BENCH / "ddp_job.py"), *cfg.workload.flags()]
            argv += ["--log-dir", str(run.log_dir)]
            if rank == 0:
                argv += ["--save", str(run.params)]
            with open(run.folder / f"rank{rank}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        wait_for(
            lambda: all(p.poll() is not None for p in procs),
            cfg.run_timeout_s,
            "the end of the DDP run",
        )
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RunFailed(f"DDP ranks exited with {codes}; see {run.folder}/rank*.log")
        result.params = run.params
    except RunFailed as error:
        result.error = str(error)
    finally:
        stop_groups(procs)
        result.wall_s = time.monotonic() - t0
        result.records = read_records(run.log_dir) if run.log_dir.is_dir() else []
    return result
