"""Where a chaos scenario runs: the `Target` protocol and what one run yields.

Where it sits: `runner.py` asks a target for one fault-free run (the reference) and one
run per `RunPlan`; `invariants.py` checks what comes back. `local.LocalTarget` runs
`keepstep run` on this machine. The cluster target (`keepstep.e2e.chaos_cluster`: a
TrainJob on the end-to-end cluster, faults applied to pods and their nodes) implements
the same two methods and lives with the end-to-end infrastructure, which the product
never imports; it takes its reference run from the local target.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from keepstep.chaos.invariants import Observation
from keepstep.chaos.model import FaultKind, Job
from keepstep.chaos.schedule import RunPlan


@dataclass(frozen=True)
class RunOutcome:
    """One run as seen after it ended."""

    run_dir: Path
    summary: dict[str, Any] | None
    events: list[dict[str, Any]]
    seen: Observation
    started_t: float
    output_tail: str = ""
    injector_error: str | None = None


class Target(Protocol):
    name: str

    def unsupported(self) -> dict[FaultKind, str]:
        """Fault kinds this target cannot apply, each with the reason (reported as a skip)."""
        ...

    def run(self, job: Job, plan: RunPlan | None, run_dir: Path) -> RunOutcome:
        """Run the job once with the plan's faults (None: fault-free), in a fresh `run_dir`."""
        ...
