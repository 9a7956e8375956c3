"""One run of one system: what a runner is given, what it hands back, and fault injection.

A runner (run_ddp, run_keepstep, run_torchrun, run_torchft) starts the system's
processes on `cfg.nodes` simulated nodes, injects `Run.faults` with `drive` when the job
has committed their step (keepstep's own launcher does this for keepstep, by step only),
waits for the end, and returns a `RunResult`: the step-log records, the faults with their
wall times, and the path of the final parameters. A run that fails keeps what it saw,
with the error. `Planned` names a run in the invocation's order; `Done` is a finished run
with its ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import BenchConfig, System
from harness.ledger import Ledger
from harness.procs import RunFailed
from harness.schedule import Fault, FaultKind
from harness.steplog import latest_world, steps_done

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
# The longest a due fault waits for the job to absorb the previous one.
SETTLE_MAX_S = 120.0


@dataclass(frozen=True)
class Run:
    system: System
    cfg: BenchConfig
    faults: tuple[Fault, ...]  # empty: the fault-free run
    folder: Path  # this run's own folder (logs, checkpoints, parameters)

    @property
    def label(self) -> str:
        return f"{self.system.value}/{'faults' if self.faults else 'fault-free'}"

    @property
    def log_dir(self) -> Path:
        return self.folder / "steps"

    @property
    def params(self) -> Path:
        return self.folder / "params.pt"


@dataclass
class RunResult:
    system: System
    faulty: bool
    wall_s: float = 0.0
    error: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # kind, node, step, t, ...
    params: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # system-specific (keepstep summary)


@dataclass(frozen=True)
class Planned:
    system: System
    faulty: bool
    repeat: int

    @property
    def label(self) -> str:
        return f"{self.system.value}/{'faults' if self.faulty else 'fault-free'} #{self.repeat}"


@dataclass
class Done:
    planned: Planned
    result: RunResult
    ledger: Ledger


def world_after(injected: Sequence[Fault], nodes: int) -> int:
    """The world size a job has once it has absorbed the `injected` faults."""
    lost = sum(1 for f in injected if f.kind is FaultKind.KILL_NODE)
    return nodes - lost + sum(1 for f in injected if f.kind is FaultKind.JOIN_NODE)


def drive(
    faults: Sequence[Fault],
    log_dir: Path,
    act: Callable[[Fault], str],
    finished: Callable[[], bool],
    timeout: float,
    nodes: int,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Inject each fault once the job has committed its step and absorbed the previous
    fault (its newest commit has the world size that fault leaves, or SETTLE_MAX_S has
    passed), so a fault never lands in the middle of the previous recovery; return when
    `finished`: the injected faults and the specs of those the job ended before.

    `act` performs one fault and returns a note (what it did). The loop polls the step
    log every 50 ms, as keepstep's launcher polls its progress records.
    """
    pending = sorted(faults, key=lambda f: f.step)
    injected: list[dict[str, Any]] = []
    absorbed: list[Fault] = []
    due_since: float | None = None
    deadline = time.monotonic() + timeout
    while not finished():
        now = time.monotonic()
        if now > deadline:
            raise RunFailed(f"the job did not finish within {timeout:.0f} s")
        done = steps_done(log_dir) if pending else 0
        if pending and pending[0].step <= done:
            due_since = now if due_since is None else due_since
            settled = latest_world(log_dir) == world_after(absorbed, nodes)
            if settled or now - due_since > SETTLE_MAX_S:
                fault = pending.pop(0)
                t = time.time()
                note = act(fault)
                injected.append(
                    {**fault.as_json(), "at_step": done, "t": t, "note": note,
                     "waited_s": round(now - due_since, 2), "settled": settled}
                )  # fmt: skip
                absorbed.append(fault)
                due_since = None
        time.sleep(0.05)
    return injected, [f.spec() for f in pending]


class JobEnd:
    """Whether a job is over: its leading process exited, or every step is committed and
    `grace` seconds have passed since (processes that outlive the job's last step, such as
    torchrun agents restarting for a node that joined too late, are then stopped)."""

    def __init__(self, lead: Callable[[], bool], log_dir: Path, steps: int, grace: float = 10.0):
        self.lead, self.log_dir, self.steps, self.grace = lead, log_dir, steps, grace
        self.completed_at: float | None = None

    def complete(self) -> bool:
        return steps_done(self.log_dir) >= self.steps

    def __call__(self) -> bool:
        if self.lead():
            return True
        if self.completed_at is None and self.complete():
            self.completed_at = time.monotonic()
        return self.completed_at is not None and time.monotonic() - self.completed_at > self.grace


def job_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of every training process: one thread, gloo on loopback."""
    return {**base, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
