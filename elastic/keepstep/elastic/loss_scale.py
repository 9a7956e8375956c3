"""Loss scaling (float16 autocast) driven by the job through torch's own GradScaler calls.

Where it sits: `keepstep.init(grad_scaler=...)` checks the scaler here; `Job.apply_update`
calls `unscale_`, `step` and `update` in the order of torch's AMP recipe, and a step whose
reduced gradient is non-finite is committed without an optimizer step by `skip_step`. The
decision to skip is the reduction's outcome, the same on every member, never a member's
own gradients: so every member skips the same steps at any world size.
"""

from __future__ import annotations

import math

import torch

from keepstep.elastic.errors import ConfigError

SCALER_NAME = "grad_scaler"  # the grad_scaler's name among the tracked state


def checked_scaler(scaler: object) -> torch.amp.GradScaler | None:
    """`scaler` if it is an enabled GradScaler (or None); ConfigError naming it if not."""
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigError(f"grad_scaler={scaler!r} is not a torch.amp.GradScaler")
    if not scaler.is_enabled():
        raise ConfigError(
            f"grad_scaler={scaler!r} is disabled (enabled=False, or a 'cuda' scaler without "
            "CUDA): pass grad_scaler=None to train without loss scaling"
        )
    return scaler


def check_not_the_scaler(name: str, obj: object, scaler: torch.amp.GradScaler | None) -> None:
    """ConfigError if tracking `obj` as `name` would track the job's scaler twice or take
    its name."""
    if scaler is not None and obj is scaler:
        raise ConfigError(
            f"tracked state {name!r} is the grad_scaler given to keepstep.init, which the "
            f"job already tracks as {SCALER_NAME!r}: pass it once, as grad_scaler="
        )
    if scaler is not None and name == SCALER_NAME:
        raise ConfigError(
            f"tracked state name {name!r} is taken by the grad_scaler given to "
            "keepstep.init; pick another name"
        )


def skip_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Let the scaler skip this step and back off, as `scaler.step(); scaler.update()` do
    for a step with inf or nan in its gradient.

    torch's GradScaler learns of inf/nan only from the gradients it unscales, and a
    non-finite step leaves none (its sum is not read). One inf gradient stands for the
    reduced one: `step` finds it and skips the optimizer, `update` backs off and resets the
    growth tracker, all through torch's public calls. The caller clears the gradients.
    """
    probe = min(
        (p for group in optimizer.param_groups for p in group["params"]),
        key=lambda p: p.numel(),
    )
    probe.grad = torch.full_like(probe, math.inf)
    scaler.step(optimizer)
    scaler.update()
