"""The warning for a learning rate that changes with nothing tracked to change it back.

Where it sits: the Job asks ``LrWatch.check`` at every commit, just before the optimizer
step, and ``LrWatch.reset`` after it restores a snapshot. The snapshot holds each param
group's lr, but not the object that moves it: a script that steps an LR scheduler without
tracking it (``job.track``) trains on, but a restarted worker or a joiner restarts that
scheduler from zero and its parameters part from the others' a few steps later. Nothing
fails then; this warning, once per process at the first commit that sees the lr move, is
the only sign. An object tracked with the job that holds this optimizer as ``.optimizer``
(every torch LR scheduler does) owns the lr, and silences it; for a job of several
optimizers, one that holds the member a group belongs to owns that group's lr.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from keepstep.elastic.errors import ScriptStateWarning
from keepstep.elastic.optimizer_group import OptimizerGroup

# frames between warnings.warn and the script's `step.commit()`:
# check <- Job.apply_update <- Step._commit <- Step.commit <- the script
_STACKLEVEL = 5


class LrWatch:
    """Compares each param group's lr with the one the last optimizer step used."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.last: list[float] | None = None
        self.warned = False

    def reset(self) -> None:
        """The lrs now in the groups are the baseline (they were just restored)."""
        self.last = self._lrs()

    def check(self, step: int, tracked: Sequence[object]) -> None:
        """Warn (once) if a group's lr changed since the last step and none of ``tracked``
        owns this optimizer."""
        now = self._lrs()
        last, self.last = self.last, now
        if self.warned or last is None or len(last) != len(now):
            return
        owners = {id(getattr(obj, "optimizer", None)) for obj in tracked}
        if id(self.optimizer) in owners:
            return
        for group, (before, after) in enumerate(zip(last, now, strict=True)):
            if before == after or (math.isnan(before) and math.isnan(after)):
                continue
            if id(self._member(group)) in owners:
                continue  # one optimizer of a group (optimizer_group.py), with its scheduler
            self.warned = True
            warnings.warn(
                ScriptStateWarning(
                    f"step {step}: the lr of optimizer param group {group} changed from "
                    f"{before:g} to {after:g}, but nothing tracked with the job owns it. "
                    "A restarted worker or a joining member restores the lr but not what "
                    "sets it (an LR scheduler restarts from zero), and its parameters would "
                    "diverge from the others'. Track the scheduler: keepstep.init(..., "
                    "state={'sched': sched}) or job.track('sched', sched), and step it after "
                    "`if step.commit():`. (An lr computed from step.index alone is safe: "
                    "then filter ScriptStateWarning.)"
                ),
                stacklevel=_STACKLEVEL,
            )
            return

    def _member(self, group: int) -> torch.optim.Optimizer:
        """The optimizer that holds param group ``group``: itself, or a group's member."""
        if isinstance(self.optimizer, OptimizerGroup):
            return self.optimizer.owner_of(group)
        return self.optimizer

    def _lrs(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]
