"""Members step with the same optimizer hyperparameters, or the step is refused.

Where it sits: at every commit ``Step`` asks ``HyperCheck.fill`` to write this member's
slots of the gradient buffer (its caller slots, no collective of its own) and, once the
buffer is summed, ``HyperCheck.check`` to read them back.

Why: an lr that one member sets from something only it sees parts the members' parameters
silently. The usual case is a metric-driven scheduler stepped with the member's own loss
(``ReduceLROnPlateau.step(loss.item())``): each member's loss is that of its own
micro-batches, so the schedulers disagree on when to cut the lr. Nothing fails; the
members' hashes differ at the end. This check turns it into an error at the first step
whose hyperparameters differ, on every member at once, naming the param group and this
member's values.

How: each param group's hyperparameters (everything but ``params``) are hashed to a small
integer ``h``; every member adds ``h`` and ``h * h`` into two slots per group. The summed
slots give ``S1 = sum(h)`` and ``S2 = sum(h * h)``, and ``W * S2 == S1 * S1`` holds exactly
when every member's ``h`` is the same (Cauchy-Schwarz), so every member reaches the same
verdict from the same sums. ``h`` has as many bits as the buffer's float format can sum
exactly for ``W`` members (16 in float64 up to 2**21 members, fewer in float32), so a
difference goes unseen in a step with probability about 2**-bits; a scheduler that parts
the members keeps them apart, and the next steps find it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError

__all__ = ["HyperCheck", "HyperparametersDiffer", "fingerprint", "hash_bits"]

_MAX_BITS = 16
_FIX = (
    "Step what sets them with what every member shares: a scheduler after `if "
    "step.commit():` from the step index or from step.commit().metrics (the global batch's "
    "mean, the same on every member), never from this member's own loss; "
    "ReduceLROnPlateau.step(result.metrics['loss']) or job.evaluate's totals."
)


class HyperparametersDiffer(ConfigError):
    """The members would step the same parameters with different hyperparameters."""


def hash_bits(world_size: int, dtype: torch.dtype) -> int:
    """Bits of ``h`` such that ``world_size * (2**bits - 1)**2`` is exact in ``dtype``."""
    significand = round(-math.log2(torch.finfo(dtype).eps)) + 1  # 24, 53
    headroom = significand - max(1, math.ceil(math.log2(world_size + 1)))
    return max(1, min(_MAX_BITS, headroom // 2))


def _plain(value: object) -> object:
    """``value`` as plain data whose ``repr`` is the same in every process for the same
    value (a float's repr round-trips exactly; a list reads as the tuple it restores to)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_plain(item) for item in value)
    if isinstance(value, torch.Tensor):  # an lr held as a tensor (capturable, fused)
        values = None
        if value.numel() <= 64 and not value.is_complex():
            values = tuple(value.detach().to("cpu", torch.float64).flatten().tolist())
        return ("tensor", str(value.dtype), tuple(value.shape), values)
    return ("object", type(value).__module__, type(value).__qualname__)  # not its address


def fingerprint(group: Mapping[str, Any]) -> bytes:
    """A param group's hyperparameters (every key but ``params``), hashed."""
    plain = [(key, _plain(group[key])) for key in sorted(k for k in group if k != "params")]
    return hashlib.blake2b(repr(plain).encode("utf-8", "backslashreplace"), digest_size=8).digest()


def describe(group: Mapping[str, Any]) -> str:
    """The group's plain hyperparameters, for an error message."""
    shown = []
    for key in sorted(k for k in group if k != "params"):
        value = group[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool | int | float | str | tuple | type(None)):
            shown.append(f"{key}={value!r}")
    return ", ".join(shown)


class HyperCheck:
    """Two caller slots per param group of ``optimizer``: its hash, and the hash squared."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups = len(optimizer.param_groups)

    @property
    def count(self) -> int:
        """The caller slots this check needs: fixed at ``keepstep.init``, as the groups are."""
        return 2 * self.groups

    def _hashes(self, bits: int) -> list[int]:
        if len(self.optimizer.param_groups) != self.groups:
            raise ConfigError(
                f"the optimizer has {len(self.optimizer.param_groups)} param groups, "
                f"{self.groups} when keepstep.init ran: the job's layout is fixed then "
                "(add_param_group before keepstep.init)"
            )
        return [
            int.from_bytes(fingerprint(g)[:4], "little") % (1 << bits)
            for g in self.optimizer.param_groups
        ]

    def fill(self, slots: torch.Tensor, world_size: int) -> None:
        """Write this member's ``h, h*h`` per group into ``slots`` (``count`` elements)."""
        bits = hash_bits(world_size, slots.dtype)
        values = [float(v) for h in self._hashes(bits) for v in (h, h * h)]
        slots.copy_(torch.tensor(values, dtype=slots.dtype))

    def check(self, summed: Iterable[float], world_size: int, step: int) -> None:
        """``HyperparametersDiffer`` naming each group whose members' hashes differ."""
        values = [int(v) for v in summed]
        differ = [
            group
            for group, (s1, s2) in enumerate(zip(values[::2], values[1::2], strict=True))
            if world_size * s2 != s1 * s1
        ]
        if not differ:
            return
        groups = self.optimizer.param_groups
        mine = "; ".join(f"this member's group {g}: {describe(groups[g])}" for g in differ)
        raise HyperparametersDiffer(
            f"step {step}: the {world_size} members would step with different optimizer "
            f"hyperparameters in param group{'s' if len(differ) > 1 else ''} "
            f"{', '.join(map(str, differ))} ({mine}), and their parameters would part. {_FIX}"
        )
