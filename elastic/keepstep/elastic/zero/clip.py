"""Clipping ZeRO-2's gradient without gathering it: torch's norm, computed from windows.

Where it sits: the job clips the reduced gradient with ``clip_grad_norm_(params,
max_norm, foreach=False)`` (job.py ``apply_update``): one norm per gradient
(``torch.linalg.vector_norm`` of the whole tensor), the norm of those norms stacked in
torch's grouping order (by device and dtype), and every gradient multiplied by
``min(max_norm / (total + 1e-6), 1)``. Under ZeRO-2 a member holds only its windows of the
gradient, and gathering all of it for the norm would undo what ZeRO-2 saves. Here each
tensor is given to one member (``assign_whole``, balanced by size), which receives the
owners' pieces of its gradient (an all-to-all: PieceGather.send_to) and takes that
tensor's norm with the same call on the whole tensor; the norms are all-gathered (8 bytes
per tensor, exact in float64), every member stacks them in the order torch's own grouping
function gives and takes the same total, and multiplies its windows by the same
coefficient. The same calls on the same values: the bits of torch's clip over the whole
gradient, with about 1/W of it held at once instead of all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from keepstep.elastic.zero.ownership import Window
from keepstep.elastic.zero.pieces import PieceGather, assign_whole

__all__ = ["clip_windows", "total_norm"]


def total_norm(norms: dict[int, torch.Tensor], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The norm of the per-tensor ``norms`` (by index into ``params``, in the order of
    ``params``) as torch's ``clip_grad_norm_`` stacks them: grouped by device and dtype by
    torch's own function, in its group order."""
    order = sorted(norms)
    if not order:
        return torch.tensor(0.0)
    stand_ins = [torch.empty(0, dtype=norms[t].dtype, device=params[t].device) for t in order]
    which = {id(s): t for s, t in zip(stand_ins, order, strict=True)}
    grouped = _group_tensors_by_device_and_dtype([stand_ins])  # type: ignore[list-item]
    stacked = [norms[which[id(s)]] for [tensors], _ in grouped.values() for s in tensors]
    first = params[order[0]].device
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(first) for n in stacked]), 2.0)
    return total


def clip_windows(
    pieces: PieceGather,
    params: Sequence[torch.Tensor],
    windows: Sequence[Window],
    grads: Sequence[torch.Tensor | None],
    given: frozenset[int],
    max_norm: float,
    timeout: timedelta,
    speeds: Sequence[float] | None = None,
) -> torch.Tensor:
    """Clip the windows' ``grads`` (one per window, None where the tensor has none) as
    ``clip_grad_norm_`` clips the whole gradient of the tensors ``given`` (those with a
    gradient, the same on every rank); returns the total norm. Each tensor's norm is taken
    by one rank, balanced over the ranks' ``speeds``. A collective: every rank calls it."""
    order = sorted(given)
    dest = assign_whole({t: params[t].numel() for t in order}, pieces.ownership.world, speeds)
    rank = pieces.gather.rank
    mine = [t for t in order if dest[t] == rank]
    # Each norm is taken where torch's clip takes it: on the tensor's own device.
    full = {
        t: torch.empty(params[t].numel(), dtype=params[t].dtype, device=params[t].device)
        for t in mine
    }
    held = list(zip(windows, grads, strict=True))
    pieces.send_to(dest, held, lambda t: full[t].view(torch.uint8), timeout)
    own = {t: torch.linalg.vector_norm(full[t].view(params[t].shape), 2.0) for t in mine}
    slots = torch.zeros(max(len(order), 1), dtype=torch.float64, device=pieces.gather.device)
    for i, t in enumerate(order):
        if t in own:
            slots[i] = own[t].to(torch.float64)  # exact: every float norm is a float64
    rows = pieces.gather.allgather(slots, timeout)
    norms = {t: own.get(t, rows[dest[t]][i].to(params[t].dtype)) for i, t in enumerate(order)}
    total = total_norm(norms, params)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for w, g in held:
        if g is not None and w.tensor in given:
            g.mul_(coef.to(g.device))
    return total
