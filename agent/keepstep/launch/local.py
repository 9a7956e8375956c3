"""Run a training script as several local processes with a scripted membership.

This is the node-agent-free harness the library's own tests and `keepstep selfcheck` use:
one process per member, a TCPStore hosted by the launcher on loopback for the process
groups (every key under a random token that only the members are given, so another local
process that finds the port can name no key of the run), and a
`ScheduleController` in each process that replays membership changes fixed in advance
(graceful shrinks and joins at step boundaries, the survivors of an injected crash, and a
crashed member's restarted process, which reopens its snapshot file as an agent's
restarted worker does).
`keepstep run` (the agent) is the production launcher; this one has no failure detection
of its own beyond the communicator's.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch._C._distributed_c10d import PrefixStore, TCPStore

from keepstep.agent.worker import stores
from keepstep.agent.worker.controller import RELEASE_TIMEOUT
from keepstep.elastic.control import CommitRecord, Membership, ScheduleController
from keepstep.elastic.errors import PeerLost
from keepstep.errors import ConfigError, KeepstepError

CONTROLLER_SPEC = "keepstep.launch.local:controller_from_env"

# The members' store and collective timeouts, x their defaults. An agent doubles an epoch's
# after a false alarm and goes on; a scripted run cannot, so a read of its store that a
# busy machine delays past the default 2 s would end it. The store is this launcher's own,
# on the same machine, and the only fault a run injects is a SIGKILL, which the
# communicator sees at once: longer timeouts cost a run nothing.
LOCAL_TIMEOUT_SCALE = 4.0


@dataclass
class _CrashingController(ScheduleController):
    """A schedule controller that SIGKILLs its own process after committing a given step.

    A failure the schedule has no epoch for ends the job. The process then releases its
    connections to the launcher's store (`stores.release_connections`): a group build the
    failure interrupted may still sit in a store call, and a thread that wakes from one
    while the interpreter exits kills the process with SIGABRT instead of the error. A
    worker that finished releases them too, as an agent's worker does: an abort watch's
    thread may still be connecting to a store that a member's exit holds up.
    """

    die_after: int | None = None
    store_address: str = ""

    def on_commit(self, record: CommitRecord) -> None:
        super().on_commit(record)
        if self.die_after is not None and record.step + 1 == self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_finish(self, done: int, params_sha256: str) -> None:
        super().on_finish(done, params_sha256)
        if self.store_address:  # the worker's part is over, as an agent's worker releases
            stores.release_connections({self.store_address}, RELEASE_TIMEOUT)

    def on_failure(self, epoch: int, done: int, error: PeerLost, timeout: float) -> Membership:
        try:
            return super().on_failure(epoch, done, error, timeout)
        except PeerLost:
            if self.store_address:
                stores.release_connections({self.store_address}, RELEASE_TIMEOUT)
            raise


def controller_from_env(env: Mapping[str, str]) -> ScheduleController:
    """Build this process's controller from the variables `run_local` sets."""
    host, _, port = env["KEEPSTEP_STORE"].rpartition(":")
    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    store = PrefixStore(env["KEEPSTEP_STORE_TOKEN"], client)
    plan = json.loads(env["KEEPSTEP_SCHEDULE"])
    die = env.get("KEEPSTEP_DIE_AFTER")
    result = env.get("KEEPSTEP_RESULT")
    return _CrashingController(
        store_=store,
        me=env["KEEPSTEP_MEMBER"],
        schedule=plan["schedule"],
        at_step=plan["at_step"],
        first_epoch=int(env.get("KEEPSTEP_FIRST_EPOCH", "0")),
        result_path=Path(result) if result else None,
        timeout_scale=float(plan.get("timeout_scale", 1.0)),
        die_after=int(die) if die else None,
        store_address=env["KEEPSTEP_STORE"],
    )


@dataclass(frozen=True)
class LocalRun:
    """A scripted run: `schedule[k]` members train in epoch k, from step `at_step[k]`.

    `at_step[k] = None` marks an epoch entered only after a crash in epoch k-1; `crash`
    maps a member to the step after whose commit it SIGKILLs itself. Members not in
    epoch 0 are started at once and wait to be admitted in `first_epoch[member]`.
    `restart` maps a crashing member to the epoch its restarted process enters: the new
    process starts once the old one is gone, with the same snapshot file. `timeout_scale`
    raises every epoch's timeouts (see `ScheduleController`); it is `LOCAL_TIMEOUT_SCALE`
    unless given.
    """

    script: str
    steps: int
    global_batch: int
    micro_batch: int
    schedule: Sequence[Sequence[str]]
    at_step: Sequence[int | None] = (0,)
    seed: int = 0
    mode: str = "exact"
    script_args: Sequence[str] = ()
    crash: Mapping[str, int] = field(default_factory=dict)
    restart: Mapping[str, int] = field(default_factory=dict)
    timeout: float = 300.0
    timeout_scale: float = LOCAL_TIMEOUT_SCALE

    def __post_init__(self) -> None:
        for member, epoch in self.restart.items():
            if member not in self.crash:
                raise ConfigError(f"restart[{member!r}]: only a member that crashes restarts")
            if not (0 < epoch < len(self.schedule) and member in self.schedule[epoch]):
                raise ConfigError(f"restart[{member!r}]={epoch}: not an epoch it is in")

    def members(self) -> list[str]:
        return sorted({m for epoch in self.schedule for m in epoch})

    def first_epoch(self, member: str) -> int:
        return next(k for k, epoch in enumerate(self.schedule) if member in epoch)


@dataclass(frozen=True)
class LocalResult:
    returncodes: dict[str, int]
    results: dict[str, dict[str, Any]]
    logs: dict[str, str]

    def finished(self) -> dict[str, dict[str, Any]]:
        """Results of the members that trained to the end."""
        return {m: r for m, r in self.results.items() if self.returncodes[m] == 0}


def run_local(run: LocalRun, run_dir: Path, env: Mapping[str, str] | None = None) -> LocalResult:
    """Run the scripted job; every process it starts is gone when it returns."""
    run_dir.mkdir(parents=True, exist_ok=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    base.update(
        KEEPSTEP_CONTROLLER=CONTROLLER_SPEC,
        KEEPSTEP_STORE=f"127.0.0.1:{store.port}",
        KEEPSTEP_STORE_TOKEN=secrets.token_hex(16),
        KEEPSTEP_SCHEDULE=json.dumps(
            {"schedule": run.schedule, "at_step": run.at_step, "timeout_scale": run.timeout_scale}
        ),
        KEEPSTEP_GLOBAL_BATCH=str(run.global_batch),
        KEEPSTEP_MICRO_BATCH=str(run.micro_batch),
        KEEPSTEP_SEED=str(run.seed),
        KEEPSTEP_MODE=run.mode,
        KEEPSTEP_STEPS=str(run.steps),
        OMP_NUM_THREADS="1",
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {member: run_dir / f"log-{member}.txt" for member in run.members()}

    def start(member: str, epoch: int, die_after: int | None) -> None:
        env_m = dict(base)
        env_m.update(
            KEEPSTEP_MEMBER=member,
            KEEPSTEP_FIRST_EPOCH=str(epoch),
            KEEPSTEP_RESULT=str(run_dir / f"result-{member}.json"),
            KEEPSTEP_SNAPSHOT=str(run_dir / f"snapshot-{member}"),
        )
        if die_after is not None:
            env_m["KEEPSTEP_DIE_AFTER"] = str(die_after)
        with open(logs[member], "ab") as out:  # a restarted process's log follows the first's
            procs[member] = subprocess.Popen(
                [sys.executable, run.script, *run.script_args],
                env=env_m,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    try:
        for member in run.members():
            start(member, run.first_epoch(member), run.crash.get(member))
        deadline = time.monotonic() + run.timeout
        to_restart = dict(run.restart)
        while to_restart or any(p.poll() is None for p in procs.values()):
            for member, epoch in list(to_restart.items()):
                code = procs[member].poll()
                if code is not None:
                    del to_restart[member]
                    if code == -signal.SIGKILL:  # its own crash; any other end stands
                        start(member, epoch, None)
            if time.monotonic() > deadline:
                running = sorted(m for m, p in procs.items() if p.poll() is None)
                raise KeepstepError(
                    f"members {running} still running after {run.timeout:.0f} s; "
                    f"see their logs in {run_dir}"
                )
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    results = {}
    for member in procs:
        path = run_dir / f"result-{member}.json"
        if path.exists():
            results[member] = json.loads(path.read_text())
    return LocalResult(
        returncodes={m: p.returncode for m, p in procs.items()},
        results=results,
        logs={m: p.read_text(errors="replace") for m, p in logs.items()},
    )


def agreed_sha(result: LocalResult) -> str:
    """The one params_sha256 every finishing member reports (ConfigError if they differ)."""
    shas: set[str] = {r["params_sha256"] for r in result.finished().values()}
    if len(shas) != 1:
        raise ConfigError(f"members disagree or none finished: {sorted(shas)}")
    return shas.pop()
