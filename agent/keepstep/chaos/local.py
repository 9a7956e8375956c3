"""The local target: a chaos run is one `keepstep run` on this machine plus an injector.

Where it sits: `runner.py` calls `LocalTarget.run` for the reference run and each faulty
run. The launcher is started as a subprocess with the plan's step-triggered faults as
`--fault` specs; an `Injector` thread applies the rest. A plan with a partition runs with
`--netns` (each node in its own network namespace; root and `ip` needed, else the fault
is skipped with the reason); other runs, the reference included, do not: the numbers are
the same either way. Once the launcher has exited, everything the run started is looked
for (process groups of its nodes, workers, etcd, snapshot files, chaos cgroups, network
namespaces and interfaces): what is found is reported as left behind, then removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from keepstep.agent.protocol.events import read_events
from keepstep.chaos.actions import send
from keepstep.chaos.inject import Applied, Injector
from keepstep.chaos.invariants import Observation
from keepstep.chaos.model import FaultKind, Job
from keepstep.chaos.rundir import CHECKPOINTS, RunView, alive, command_line, process_group
from keepstep.chaos.schedule import RunPlan
from keepstep.chaos.target import RunOutcome
from keepstep.launch import netns

PARTITION_SKIP = (
    "partition-node puts every simulated node in its own network namespace (`keepstep run "
    "--netns`) and cuts the node's veth; that needs "
)
OPERATOR_SKIP = "local mode has no operator: restart-operator runs in cluster mode only"
_GRACE_S = 60.0


class LocalTarget:
    name = "local"

    def __init__(
        self,
        python: str = sys.executable,
        poll_s: float = 0.02,
        euid: int | None = None,
        ip: str | None = "ip",
    ) -> None:
        """`euid`: this process's unless given; `ip`: the command, looked up on PATH (None:
        there is none). Tests pass others to see what an unprivileged machine does."""
        self.python = python
        self.poll_s = poll_s
        self.ip = shutil.which(ip) if ip else None
        self.netns_missing = netns.missing(os.geteuid() if euid is None else euid, self.ip)

    def unsupported(self) -> dict[FaultKind, str]:
        skip = {FaultKind.RESTART_OPERATOR: OPERATOR_SKIP}
        if self.netns_missing is not None:
            skip[FaultKind.PARTITION_NODE] = PARTITION_SKIP + self.netns_missing
        return skip

    def command(self, job: Job, plan: RunPlan | None, run_dir: Path) -> list[str]:
        argv = [
            self.python, "-m", "keepstep", "run",
            "--nodes", str(job.nodes),
            "--nproc-per-node", str(job.nproc_per_node),
            "--min-nodes", str(job.min_nodes),
            # The harness starts every node at once and its scenarios count on all of them
            # from the first step: the first epoch waits for them, however loaded the machine.
            "--admission-grace", str(job.timeout),
            "--global-batch", str(job.global_batch),
            "--micro-batch", str(job.micro_batch),
            "--steps", str(job.steps),
            "--seed", str(job.seed),
            "--mode", job.mode,
            "--hang-timeout", str(job.hang_timeout),
            "--timeout", str(job.timeout),
            "--run-dir", str(run_dir),
        ]  # fmt: skip
        if job.checkpoint_every:
            argv += ["--checkpoint", (run_dir / CHECKPOINTS).as_uri()]
            argv += ["--checkpoint-every", str(job.checkpoint_every)]
        if job.etcd_members != 1:
            argv += ["--etcd-members", str(job.etcd_members)]
        if job.shard is not None:
            argv += ["--shard", job.shard]
        for spec in plan.native_specs if plan is not None else ():
            argv += ["--fault", spec]
        partitions = plan is not None and any(
            f.kind is FaultKind.PARTITION_NODE for f in plan.faults
        )
        if partitions and self.netns_missing is None:
            argv.append("--netns")
        return [*argv, job.script, *job.script_args]

    def run(self, job: Job, plan: RunPlan | None, run_dir: Path) -> RunOutcome:
        run_dir = run_dir.resolve()
        if run_dir.exists():
            shutil.rmtree(run_dir)  # event logs are appended to: an old run would mix in
        run_dir.mkdir(parents=True)
        out_path = run_dir / "launcher.out"
        started = time.time()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                self.command(job, plan, run_dir),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        injected = plan.injected if plan is not None else ()
        injector = Injector(
            run_dir, proc.pid, injected, self.unsupported(), self.poll_s, ip=self.ip
        )
        injector.start()
        try:
            code = _wait(proc, job.timeout + _GRACE_S)
        except BaseException:
            # Interrupted: put back what the injector holds (a frozen node cannot even be
            # killed), then let the launcher end its nodes.
            injector.finish()
            _wait(proc, 0.0)
            raise
        ended = time.time()
        records = injector.finish()
        summary = _load(run_dir / "summary.json")
        native = _native_records(plan, summary, proc_out=out_path)
        faults = sorted([*records, *native], key=lambda r: r.index)
        events = read_events(run_dir)
        view = injector.view
        view.poll()
        leftovers = _leftovers(view, job, injector)
        if self.ip is not None:
            leftovers += netns.remove_leftovers(run_dir, self.ip)
        seen = Observation(
            code,
            ended,
            tuple(r.as_dict() for r in faults),
            tuple(leftovers),
            tuple(sorted(view.checkpoints.items())),
        )
        error = repr(injector.error) if injector.error is not None else None
        tail = out_path.read_text(errors="replace")[-3000:]
        return RunOutcome(run_dir, summary, events, seen, started, tail, error)


def _wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The launcher's exit code; past `timeout` it is stopped (None if it had to be killed)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher ends every node it started on SIGTERM
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            send(proc.pid, signal.SIGKILL, group=True)
            proc.wait(timeout=10)
            return None


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def _native_records(
    plan: RunPlan | None, summary: dict[str, Any] | None, proc_out: Path
) -> list[Applied]:
    """Records of the faults the launcher injected, from its fault log."""
    if plan is None:
        return []
    logged = list((summary or {}).get("faults", []))
    out = []
    for index in plan.native_indices:
        fault = plan.faults[index]
        rec = Applied(index, fault.kind.value, None, str(fault), "launcher")
        rec.scheduled_step = fault.at.step
        match = next((f for f in logged if f.get("spec") == fault.spec()), None)
        if match is not None:
            logged.remove(match)
            rec.node, rec.t, rec.step = match.get("node"), match.get("t"), match.get("step")
            rec.held = match.get("held")
        else:
            rec.node = f"n{fault.node}" if fault.node is not None else None
            rec.skipped = f"the launcher did not inject it (see {proc_out.name})"
        out.append(rec)
    return out


def _leftovers(view: RunView, job: Job, injector: Injector) -> list[str]:
    """Everything of the run still there after `keepstep run` returned; each is removed."""
    found: list[str] = []
    for node, pgid in sorted(view.agents.items()):
        for pid in process_group(pgid):
            found.append(f"process {pid} of node {node}: {command_line(pid)[:120]}")
            send(pid, signal.SIGKILL)
            send(pid, signal.SIGCONT)
    script = str(Path(job.script).name)
    for member, pid in sorted(view.workers.items()):
        if alive(pid) and script in command_line(pid):
            found.append(f"worker {member} (pid {pid})")
            send(pid, signal.SIGKILL)
    for pid in injector.etcd_pids:
        if alive(pid) and "etcd" in command_line(pid):
            found.append(f"etcd (pid {pid})")
            send(pid, signal.SIGKILL)
    job_id = view.job_id()
    if job_id is not None:
        for node in sorted(view.agents):
            for shm in sorted(view.snapshot_dir(node).glob(f"keepstep-{job_id}-{node}-*")):
                found.append(f"snapshot file {shm}")
                shm.unlink(missing_ok=True)
    for group in injector.cgroups:
        if group.path.exists():
            found.append(f"cgroup {group.path}")
            try:
                group.release()
            except OSError as error:
                found.append(f"cgroup {group.path} could not be removed: {error}")
    return found
