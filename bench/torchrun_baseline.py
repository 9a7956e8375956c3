"""Restart-the-world MTTR (torchrun) beside keepstep's, for the same job, in one run.

    scripts/env python bench/torchrun_baseline.py [--faults 20] [--json PATH]

Runs bench/torchrun_job.py (examples/mlp.py's job under plain DDP, a checkpoint every
step) with elastic torchrun: `--nnodes 1 --nproc-per-node 4 --max-restarts 5
--rdzv-backend c10d`. At chosen steps it SIGKILLs one worker (a child of the torchrun
process, a different rank each time) and measures MTTR = kill -> the first step committed
by the restarted group, with its parts: `stop` (kill -> the first new worker process is
created: torchrun notices and tears the group down), `start` (-> every new worker has its
process group and the checkpoint loaded: python + torch import, rendezvous, restore), and
`first step`. Up to `--faults-per-run` (<= max restarts) kills per torchrun run, runs
repeated until `--faults` were measured. Then, in the same invocation, it measures
keepstep's kill-worker MTTR for the same job through bench/mttr.py (4 nodes, same batch
split and --sleep) and prints both p50s and the ratio torchrun / keepstep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mttr
from harness.procs import children, free_port

REPO = Path(__file__).resolve().parents[1]
NPROC = 4
MAX_RESTARTS = 5


@dataclass(frozen=True)
class Baseline:
    global_batch: int
    micro_batch: int
    sleep: float
    faults_per_run: int = 5
    spacing: int = 15  # committed steps between kills
    first_step: int = 10
    tail_steps: int = 10
    step_timeout: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.faults_per_run <= MAX_RESTARTS:
            raise ValueError(
                f"--torchrun-per-run {self.faults_per_run} must be 1..{MAX_RESTARTS} "
                "(torchrun's --max-restarts)"
            )

    @property
    def steps(self) -> int:
        return self.first_step + self.faults_per_run * self.spacing + self.tail_steps


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now: read it on the next poll
    return out


def wait_for(cond: Any, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.005)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def run_torchrun(b: Baseline, faults: int, workdir: Path, index: int) -> list[dict[str, Any]]:
    """One torchrun job with `faults` kills; one record per kill."""
    run = workdir / f"torchrun-{index}"
    run.mkdir(parents=True)
    log, ckpt = run / "steps.jsonl", run / "model.pt"
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(NPROC), "--max-restarts", str(MAX_RESTARTS),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(REPO / "bench" / "torchrun_job.py"),
        "--step-log", str(log), "--checkpoint", str(ckpt),
        "--global-batch", str(b.global_batch), "--micro-batch", str(b.micro_batch),
        "--steps", str(b.steps), "--sleep", str(b.sleep),
    ]  # fmt: skip
    # Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE the restarted workers read the previous
    # round's gloo addresses from the shared rendezvous store and never connect
    # (pytorch/pytorch#135712; seen with torch 2.15): every restart would fail.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    records = []
    with open(run / "torchrun.log", "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            for k in range(faults):
                target = b.first_step + k * b.spacing
                events = wait_for(
                    lambda t=target: [
                        e for e in read_log(log) if e["event"] == "step" and e["step"] >= t
                    ],
                    b.step_timeout,
                    f"step {target}",
                    proc,
                )
                restart = events[-1]["restart"]
                pids = wait_for(
                    lambda: children(proc.pid, b"torchrun_job.py"), 10.0, "worker processes", proc
                )
                victim = pids[k % len(pids)]
                t_kill = time.time()
                os.kill(victim, signal.SIGKILL)
                after = wait_for(
                    lambda r=restart: [
                        e for e in read_log(log) if e["event"] == "step" and e["restart"] > r
                    ],
                    b.step_timeout,
                    "a step after the restart",
                    proc,
                )
                new = [e for e in read_log(log) if e["restart"] == after[0]["restart"]]
                starts = [e["t_process"] for e in new if e["event"] == "start"]
                ready = [e["t"] for e in new if e["event"] == "ready"]
                first = after[0]
                before = [
                    e["step"] for e in read_log(log) if e["event"] == "step" and e["t"] <= t_kill
                ]
                records.append(
                    {
                        "mttr_s": first["t"] - t_kill,
                        "stop_s": min(starts) - t_kill,
                        "start_s": max(ready) - min(starts),
                        "first_step_s": first["t"] - max(ready),
                        # The step in flight at the kill is lost; a checkpoint every step
                        # means nothing committed is.
                        "committed_at_kill": max(before),
                        "resumed_step": min(e["step"] for e in new if e["event"] == "ready"),
                    }
                )
                print(
                    f"  torchrun run {index} kill {k}: MTTR {records[-1]['mttr_s']:.2f} s",
                    flush=True,
                )
            code = proc.wait(timeout=b.step_timeout)
            done = max((e["step"] for e in read_log(log) if e["event"] == "step"), default=0)
            if code != 0 or done != b.steps:
                raise RuntimeError(f"torchrun exited with {code} after {done}/{b.steps} steps")
        finally:
            stop(proc, log)
    return records


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """End torchrun and every worker it started (each runs in a session of its own)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its workers, then exits
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for pid in {e["pid"] for e in read_log(log)}:
        try:
            # Only if the pid still is one of our workers (pids are reused).
            if str(log).encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def figures(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    mttrs = [r["mttr_s"] for r in records]
    return {
        "count": len(records),
        "mttr_p50_s": mttr.percentile(mttrs, 0.5),
        "mttr_p95_s": mttr.percentile(mttrs, 0.95),
        "phase_p50_s": {k: mttr.percentile([r[k] for r in records], 0.5) for k in keys},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20, help="for torchrun and for keepstep")
    parser.add_argument("--torchrun-per-run", type=int, default=5, help="kills per torchrun run")
    parser.add_argument("--torchrun-spacing", type=int, default=15, help="steps between kills")
    parser.add_argument("--json", help="also write every figure and record here")
    mttr.add_settings_args(parser)
    args = parser.parse_args()
    try:
        s = mttr.settings_from(args)
        b = Baseline(
            s.global_batch, s.micro_batch, s.sleep, args.torchrun_per_run, args.torchrun_spacing
        )
    except ValueError as error:
        parser.error(str(error))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-torchrun-"))
    t0 = time.monotonic()
    try:
        records: list[dict[str, Any]] = []
        index = 0
        while len(records) < args.faults:
            n = min(b.faults_per_run, args.faults - len(records))
            records += run_torchrun(b, n, workdir, index)
            index += 1
        torchrun = figures(records, ("stop_s", "start_s", "first_step_s"))
        keepstep = mttr.measure(["kill-worker"], args.faults, s, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    ks = keepstep["kinds"]["kill-worker"]
    tp = torchrun["phase_p50_s"]
    print(
        f"\ntorchrun restart-the-world, {torchrun['count']} worker kills: MTTR p50 "
        f"{torchrun['mttr_p50_s']:.3f} s, p95 {torchrun['mttr_p95_s']:.3f} s "
        f"(p50: stop {tp['stop_s']:.3f}, start {tp['start_s']:.3f}, "
        f"first step {tp['first_step_s']:.3f})"
    )
    if ks["mttr_p50_s"] is None:
        raise SystemExit(f"keepstep: no kill-worker recovery measured: {keepstep['violations']}")
    ratio = torchrun["mttr_p50_s"] / ks["mttr_p50_s"]
    print(
        f"keepstep kill-worker, {ks['count']} kills: MTTR p50 {ks['mttr_p50_s']:.3f} s, "
        f"p95 {ks['mttr_p95_s']:.3f} s\n"
        f"MTTR p50 ratio torchrun / keepstep: {ratio:.1f}x"
    )
    for v in keepstep["violations"]:
        print(f"VIOLATION (keepstep): {v}")
    print(f"({time.monotonic() - t0:.0f} s in all)")
    if args.json:
        report = {
            "job": {"global_batch": s.global_batch, "micro_batch": s.micro_batch,
                    "sleep": s.sleep, "workers": NPROC, "torchrun_steps": b.steps},
            "torchrun": {**torchrun, "records": records},
            "keepstep_kill_worker": keepstep,
            "ratio_p50": ratio,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
