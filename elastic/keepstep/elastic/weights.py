"""Micro-batch weights for a weighted mean (``keepstep.init(weighted_mean=True)``).

Where it sits: ``Step.backward(loss_sum, weight=n)`` adds each micro-batch's weight to the
member's total; the commit writes that total into the member's own caller slot of the
gradient buffer, so the sum that reduces the gradient hands every member every member's
total, exactly (x + 0 = x). The step's gradient is then the summed gradient over the
summed weights (reduce_exact.py's divisor), the global batch's mean per unit.

Why integers: a weight counts units (tokens that are not padding, samples that are not
masked). Integer sums are exact in any order, so the divisor is the same on every member
and at every world size; float weights summed in a different grouping would not be.
"""

from __future__ import annotations

import math
import operator

import torch

from keepstep.elastic.errors import ConfigError

__all__ = ["check_exact_in", "micro_batch_weight"]

_WEIGHTED = "keepstep.init(..., weighted_mean=True)"


def micro_batch_weight(weight: object, weighted: bool) -> int:
    """``weight`` as the int it counts; ``ConfigError`` naming it unless it is a count >= 0
    (an int, or an integer tensor of one element), given exactly when the job is weighted."""
    if not weighted:
        if weight is not None:
            raise ConfigError(f"step.backward(loss, weight={weight!r}) needs {_WEIGHTED}")
        return 0
    if weight is None:
        raise ConfigError(
            f"{_WEIGHTED}: pass each micro-batch's loss summed over its units and their "
            "count, step.backward(loss_sum, weight=n)"
        )
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_floating_point() or weight.is_complex():
            raise ConfigError(
                f"weight: a {weight.dtype} tensor of shape {tuple(weight.shape)}; a weight "
                "is a count, an integer tensor of one element (e.g. mask.sum())"
            )
        value = int(weight.item())
    else:
        try:
            value = operator.index(weight)  # type: ignore[arg-type]
        except TypeError:
            raise ConfigError(
                f"weight={weight!r}: a weight is a count (an int), so that its sum is exact"
            ) from None
        if isinstance(weight, bool):
            raise ConfigError(f"weight={weight!r}: a weight is a count (an int), not a bool")
    if value < 0:
        raise ConfigError(f"weight={value}: a count must be >= 0")
    return value


def check_exact_in(total: int, dtype: torch.dtype) -> int:
    """``total``, after checking that the buffer's float format holds it exactly."""
    bits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # significand bits: 24, 53
    if total >= 2**bits:
        raise ConfigError(
            f"this member's micro-batch weights sum to {total} in one step, beyond the "
            f"2**{bits} a {dtype} buffer holds exactly (mode='fast'?); use mode='exact'"
        )
    return total
