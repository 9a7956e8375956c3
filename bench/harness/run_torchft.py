"""TorchFT: one replica group per node, its lighthouse, gloo; per-step fault tolerance.

Starts torchft's `torchft_lighthouse` binary on loopback (min_replicas = the job's
minimum nodes; heartbeat timeout = the detector timeout keepstep gets instead of 5 s; join
timeout 10 s instead of 60 s), then bench/torchft_job.py once per replica group, each in a
session of its own; the first ones wait for each other before their first quorum. This
launcher plays the part of the job supervisor (torchx, a Kubernetes restart policy):

    kill-node:K    SIGKILL replica group K; it stays down (its data shard is not trained);
    join-node      start a replacement for the lost group, same shard, which heals from a
                   peer and joins the quorum;
    kill-worker:K  SIGKILL replica group K and start it again at once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.procs import RunFailed, free_port, kill_group, stop_groups, wait_for
from harness.runs import BENCH, JobEnd, Run, RunResult, drive, job_env
from harness.schedule import Fault, FaultKind
from harness.steplog import read_records

# How long a quorum waits for a replica that heartbeats but has not asked to join yet (a
# restarted one loading its model): long enough for that, short of torchft's 60 s default.
JOIN_TIMEOUT_MS = 10_000
DATA_MODE = "loader"
# What `bench/run --torchft-grad-sync ddp` records (torchft 0.2.0, CPU, gloo): when a peer
# dies during the all-reduce, the wrapper's comm hook waits on the failed work (the Manager
# logs "got exception waiting for work ... Connection closed by peer" and latches the
# error), then asserts on the future that wait never set, and the survivor exits.
DDP_WRAPPER_FAILURE = (
    'AssertionError (File "site-packages/torchft/ddp.py", line 76, in _comm_hook: '
    "assert fut._fut) in the surviving replica groups after a peer is killed"
)  # torchft's example: a per-replica sampler position (see torchft_job.py)


def lighthouse_binary() -> str:
    """`torchft_lighthouse` next to this Python (the torchft wheel installs it there)."""
    beside = Path(sys.executable).with_name("torchft_lighthouse")
    found = str(beside) if beside.is_file() else shutil.which("torchft_lighthouse")
    if not found:
        raise RunFailed("torchft_lighthouse not found (pip install torchft)")
    return found


def last_error(log: Path) -> str | None:
    """The exception line that ended a process, with the source line it was raised at."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for i in range(len(lines) - 1, -1, -1):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", lines[i]):
            where = next((x.strip() for x in reversed(lines[:i]) if x.startswith("  File")), "")
            # Paths from the installed package or this checkout, not from this machine.
            where = re.sub(r'"[^"]*/(site-packages|bench)/', r'"\1/', where)
            return f"{lines[i].strip()} ({where})" if where else lines[i].strip()
    return None


def run_torchft(run: Run) -> RunResult:
    cfg, w = run.cfg, run.cfg.workload
    run.folder.mkdir(parents=True, exist_ok=True)
    result = RunResult(run.system, faulty=bool(run.faults))
    beat_ms = str(int(cfg.detect_timeout_s * 1000))
    replicas: dict[int, subprocess.Popen[bytes]] = {}
    retired: list[subprocess.Popen[bytes]] = []
    env = job_env(dict(os.environ, RUST_LOG="warn"))
    port = free_port()
    lighthouse: subprocess.Popen[bytes] | None = None

    def start(replica: int, first: bool = False) -> None:
        argv = [
            sys.executable, str(BENCH / "torchft_job.py"), *w.flags(),
            "--log-dir", str(run.log_dir), "--replica", str(replica),
            "--replicas", str(cfg.nodes), "--lighthouse", f"http://127.0.0.1:{port}",
            "--min-replicas", str(cfg.min_nodes), "--data", DATA_MODE,
            "--save", str(run.folder / f"params-replica{replica}.pt"),
            "--wait-for", str(cfg.nodes if first else 0), "--grad-sync", cfg.torchft_grad_sync,
        ]  # fmt: skip
        with open(run.folder / f"replica{replica}.log", "ab") as out:
            replicas[replica] = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    lost: list[int] = []

    def act(fault: Fault) -> str:
        if fault.kind is FaultKind.JOIN_NODE:
            if not lost:
                return "no lost replica group to replace"
            replica = lost.pop(0)
            start(replica)
            return f"started a replacement for replica group {replica}"
        assert fault.node is not None
        proc = replicas[fault.node]
        kill_group(proc)
        proc.wait(timeout=10)
        retired.append(proc)
        if fault.kind is FaultKind.KILL_NODE:
            lost.append(fault.node)
            return f"SIGKILL replica group {fault.node} (stays down)"
        start(fault.node)
        return f"SIGKILL replica group {fault.node}, restarted at once"

    def finished() -> bool:
        # Replica group 0 is never a victim: the job is over when it is. A group started
        # late (a replacement) may still be loading then; it is stopped.
        return replicas[0].poll() is not None

    t0 = time.monotonic()
    try:
        argv = [lighthouse_binary(), "--bind", f"127.0.0.1:{port}"]
        argv += ["--min_replicas", str(cfg.min_nodes), "--join_timeout_ms", str(JOIN_TIMEOUT_MS)]
        argv += ["--heartbeat_timeout_ms", beat_ms]
        with open(run.folder / "lighthouse.log", "wb") as out:
            lighthouse = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        for replica in range(cfg.nodes):
            start(replica, first=True)
        end = JobEnd(finished, run.log_dir, w.steps)
        result.faults, skipped = drive(
            run.faults, run.log_dir, act, end, cfg.run_timeout_s, cfg.nodes
        )
        if skipped:
            result.extra["faults_not_injected"] = skipped
        try:  # the others finish the same last step; a late replacement may never
            wait_for(
                lambda: all(p.poll() is not None for p in replicas.values()),
                5.0,
                "the other replica groups to exit",
            )
        except RunFailed:
            pass
        code = replicas[0].returncode
        if code not in (0, None) or not end.complete():
            raise RunFailed(
                f"replica group 0 exited with {code}"
                + ("" if end.complete() else " before the last step")
                + ": "
                + (last_error(run.folder / "replica0.log") or "no traceback")
            )
        # Replica group 0 is never a victim; every live group holds the same parameters.
        result.params = run.folder / "params-replica0.pt"
    except RunFailed as error:
        result.error = str(error)
    finally:
        stop_groups([*replicas.values(), *([lighthouse] if lighthouse else [])])
        result.wall_s = time.monotonic() - t0
        result.records = read_records(run.log_dir) if run.log_dir.is_dir() else []
    result.extra["data_mode"] = DATA_MODE
    result.extra["grad_sync"] = cfg.torchft_grad_sync
    result.extra["ddp_wrapper_failure"] = DDP_WRAPPER_FAILURE
    result.extra["lighthouse"] = {
        "min_replicas": cfg.min_nodes,
        "join_timeout_ms": JOIN_TIMEOUT_MS,
        "heartbeat_timeout_ms": int(beat_ms),
    }
    return result
