"""The optimizer is the job's to step: a script's own ``optimizer.step()`` is refused.

Where it sits: ``Job`` builds one ``StepGuard`` over the script's optimizer (each member of
a list), marks the time ``job.steps()`` runs with ``loop`` and its own optimizer step with
``job_steps``; the hook that torch's ``Optimizer.register_step_pre_hook`` calls refuses any
other step meanwhile.

Why: a script ported from a plain loop keeps its ``clip_grad_norm_(model.parameters(),
1.0); optimizer.step()`` before ``step.commit()``. In a job the micro-batches' gradients
are summed in the job's buffer, not in ``.grad``, until the commit reduces them and steps
the optimizer: the script's clipping sees no gradient (it returns a norm of 0 and clips
nothing) and its step steps nothing, and the job trains unclipped with no sign of it. The
step is where that port shows, so it is refused there, naming both fixes. Outside
``job.steps()`` (a reference computed before, a fine-tune after) the optimizer is the
script's again.

The same holds for the ``grad_scaler`` the job drives: the AMP recipe's
``scaler.unscale_(opt)``, ``scaler.step(opt)`` and ``scaler.update()`` are the job's to call
inside the loop. Left in a ported loop they would fail inside torch ("No inf checks were
recorded for this optimizer": ``.grad`` holds nothing yet), or record an unscale the job's
own would then trip over; ``guard_scaler`` refuses them by name instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.optimizer_group import OptimizerGroup

__all__ = ["GuardHook", "StepGuard"]

_WHY = (
    "inside job.steps(), step.commit() reduces the global batch's gradient and steps the "
    "optimizer; until then the gradient is summed in the job's buffer, not in .grad, so a "
    "step of the script's would step nothing. Remove optimizer.step() (and "
    "optimizer.zero_grad(), scaler.step(), scaler.update()) from the loop. Clipping is "
    "keepstep.init(..., clip_grad_norm=max_norm): a clip_grad_norm_ of the script's before "
    "the commit sees no gradient and clips nothing; anything else done to the reduced "
    "gradient belongs in job.before_optimizer_step(fn)"
)


class GuardHook:
    """The pre-hook itself, a type of its own: ZeRO, which refuses the script's step hooks
    (zero/optimizers.py), knows this one as the job's."""

    def __init__(self, guard: StepGuard) -> None:
        self.guard = guard

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.guard.check(optimizer)


class StepGuard:
    """A step pre-hook on the script's optimizer(s) that refuses steps the job did not take."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        targets = optimizer.optimizers if isinstance(optimizer, OptimizerGroup) else [optimizer]
        self._in_loop = False
        self._job_stepping = False
        self._handles = [opt.register_step_pre_hook(GuardHook(self)) for opt in targets]
        self._scalers: list[torch.amp.GradScaler] = []

    @contextmanager
    def loop(self) -> Iterator[None]:
        """While ``job.steps()`` runs: only the job steps the optimizer."""
        before, self._in_loop = self._in_loop, True
        try:
            yield
        finally:
            self._in_loop = before

    @contextmanager
    def job_steps(self) -> Iterator[None]:
        """The job's own optimizer step (or a grad_scaler's skip of it)."""
        before, self._job_stepping = self._job_stepping, True
        try:
            yield
        finally:
            self._job_stepping = before

    def refuses(self) -> bool:
        """Whether a step (or a grad scaler's call) now would be the script's, in the loop."""
        return self._in_loop and not self._job_stepping

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """``ConfigError`` for a step of ``optimizer`` the job is not taking, in its loop."""
        if self.refuses():
            raise ConfigError(f"{type(optimizer).__name__}.step() called by the script: {_WHY}")

    def guard_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Refuse the script's ``unscale_``, ``step`` and ``update`` of ``scaler`` (the
        job's ``grad_scaler``) inside the loop, as its optimizer's step is refused."""
        for name in _SCALER_CALLS:
            setattr(scaler, name, _GuardedCall(self, getattr(scaler, name), name))
        self._scalers.append(scaler)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for scaler in self._scalers:
            for name in _SCALER_CALLS:
                vars(scaler).pop(name, None)  # the class's methods again
        self._scalers.clear()


_SCALER_CALLS = ("unscale_", "step", "update")


class _GuardedCall:
    """One of a grad scaler's methods, refused to the script inside the loop."""

    def __init__(self, guard: StepGuard, call: Any, name: str) -> None:
        self.guard, self.call, self.name = guard, call, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.guard.refuses():
            raise ConfigError(
                f"GradScaler.{self.name}() called by the script: the job given "
                f"grad_scaler= unscales the reduced gradient, skips a step with inf or nan "
                f"and updates the scale itself at step.commit(); keep only "
                f"step.backward(scaler.scale(loss)). {_WHY}"
            )
        return self.call(*args, **kwargs)
