"""torchrun: restart the world from a checkpoint saved every step.

One elastic torchrun agent per simulated node (`--nnodes N-1:N --nproc-per-node 1`, c10d
rendezvous on node 0, `--max-restarts`), each in a session of its own, running
bench/ddp_job.py with `--checkpoint`. A round closes once its minimum has arrived and
`last_call_timeout` has passed, so the minimum is N-1: with a lower one, a survivor
whose worker failed a few seconds after the others (a loaded machine) is left out of
the new world and waits for the next restart. Faults:

    kill-node:K    SIGKILL node K's agent and worker (its whole process group); the
                   survivors' workers fail in the all-reduce, their agents stop them and
                   meet in a new rendezvous round of the remaining nodes;
    join-node      start one more agent; the running agents see it waiting and restart
                   their workers into a round that includes it;
    kill-worker:K  SIGKILL node K's worker; its agent restarts it, the others restart too.

Every restart resumes from the last checkpoint. torchrun's rendezvous timings are set
near keepstep's failure detector instead of their defaults (30 s `last_call_timeout`,
how long a round with enough nodes waits for more; a dead node evicted after 3 missed
keep-alives 5 s apart, and the survivors' new round waits for that eviction), so
torchrun is not charged for defaults nobody would keep: `last_call_timeout` and the
keep-alive interval = the detector timeout, eviction after three missed keep-alives.
Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE, restarted workers read the previous round's
gloo addresses from the shared store and never connect (pytorch/pytorch#135712).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from harness.procs import RunFailed, children, free_port, kill_tree, stop_groups, wait_for
from harness.runs import BENCH, JobEnd, Run, RunResult, drive, job_env
from harness.schedule import Fault, FaultKind
from harness.steplog import read_records

MAX_RESTARTS = 50
# A dead node leaves the rendezvous after this many missed keep-alives; until it does,
# the survivors' new round cannot start. Two proved too few on a loaded machine (live
# nodes were evicted and a second world formed beside the first).
KEEP_ALIVE_BEATS = 3


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def run_torchrun(run: Run) -> RunResult:
    cfg, w = run.cfg, run.cfg.workload
    run.folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    agents: dict[int, subprocess.Popen[bytes]] = {}
    result = RunResult(run.system, faulty=bool(run.faults))
    # LOGLEVEL=INFO: the agents log every rendezvous round and restart (node*.log).
    env = job_env(dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO"))

    beat = int(cfg.detect_timeout_s)
    # A dead node leaves the rendezvous after KEEP_ALIVE_BEATS missed keep-alives.
    rdzv_conf = (
        f"last_call_timeout={beat},keep_alive_interval={beat},"
        f"keep_alive_max_attempt={KEEP_ALIVE_BEATS},join_timeout=600"
    )

    def start(node: int) -> None:
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", f"{cfg.nodes - 1}:{cfg.nodes}", "--nproc-per-node", "1",
            "--max-restarts", str(MAX_RESTARTS), "--monitor-interval", "0.1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run.folder.name,
            "--rdzv-conf", rdzv_conf,
            str(BENCH / "ddp_job.py"), *w.flags(),
            "--log-dir", str(run.log_dir), "--checkpoint", str(run.folder / "ckpt.pt"),
            "--save", str(run.params),
        ]  # fmt: skip
        with open(run.folder / f"node{node}.log", "ab") as out:
            agents[node] = subprocess.Popen(
                argv,
                env={**env, "BENCH_NODE": str(node)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def act(fault: Fault) -> str:
        if fault.kind is FaultKind.JOIN_NODE:
            node = max(agents) + 1
            start(node)
            return f"started node{node}'s agent"
        assert fault.node is not None
        agent = agents[fault.node]
        if fault.kind is FaultKind.KILL_NODE:
            kill_tree(agent)
            return f"SIGKILL node{fault.node} (agent and worker)"
        # The worker may be between restarts: wait for it to exist.
        pids = wait_for(lambda: children(agent.pid, b"ddp_job.py"), 60.0, "a worker to kill")
        os.kill(pids[0], signal.SIGKILL)
        return f"SIGKILL node{fault.node}'s worker {pids[0]}"

    t0 = time.monotonic()
    try:
        start(0)  # node 0 hosts the rendezvous store: it binds the port first
        wait_for(lambda: _listening(port), 120.0, "torchrun's rendezvous store")
        for node in range(1, cfg.nodes):
            start(node)
        end = JobEnd(lambda: agents[0].poll() is not None, run.log_dir, w.steps)
        result.faults, skipped = drive(
            run.faults, run.log_dir, act, end, cfg.run_timeout_s, cfg.nodes
        )
        if skipped:
            result.extra["faults_not_injected"] = skipped
        try:  # the others end with node 0; a joiner still waiting to be admitted does not
            wait_for(lambda: all(p.poll() is not None for p in agents.values()), 15.0, "")
        except RunFailed:
            pass
        if not end.complete():
            raise RunFailed(
                f"node0's torchrun exited with {agents[0].returncode} before the last step"
            )
        if agents[0].returncode != 0:  # e.g. RendezvousClosedError after the last step
            result.extra["node0_exit"] = agents[0].returncode
        result.params = run.params
    except RunFailed as error:
        result.error = str(error)
    finally:
        stop_groups(list(agents.values()))
        result.wall_s = time.monotonic() - t0
        result.records = read_records(run.log_dir) if run.log_dir.is_dir() else []
    return result
