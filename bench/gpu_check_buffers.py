"""The BatchNorm section of bench/gpu_check.py: buffers a forward changes, kept in step on
the device (keepstep.elastic.buffers) as on the CPU.

Where it sits: gpu_check_more.run calls `batchnorm_buffers(section, device)`. In one
process it plays one step of 1, 2 and 3 members, each member a copy of a small
convolutional model with BatchNorm on the device computing its own micro-batches: every
member must end with the same running statistics and counter at every world size
(``buffers_members_agree``), and the mean the device computed from the summed rows must be
the CPU's from the same rows, bit for bit (``buffers_device_mean_is_cpu``: float64 sums and
a division, rounded the same on both).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

from keepstep.elastic.buffers import BufferSync  # noqa: E402

N_MICRO = 6
SPLITS = ([[0, 1, 2, 3, 4, 5]], [[0, 2, 4], [5, 3, 1]], [[1], [0, 3], [5, 4, 2]])


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
    return net.to(device)


def _step(members: list[list[int]], device: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One step of ``members``: the first member's BatchNorm state, and the summed rows."""
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(4, 3, 12, 12, generator=g).to(device) * (1 + i) for i in range(N_MICRO)]
    models = [_model(device) for _ in members]
    syncs = [BufferSync(m, N_MICRO) for m in models]
    flags = []
    for model, sync, ids in zip(models, syncs, members, strict=True):
        sync.begin_step()
        for mb in ids:
            model(data[mb])
            sync.end_micro_batch(mb)
        flags.append(sync.flags())
    changed = [sum(column) > 0 for column in zip(*flags, strict=True)]
    summed = syncs[0].gather(changed, torch.device(device))
    for sync in syncs[1:]:
        summed += sync.gather(changed, torch.device(device))
    for sync in syncs:
        sync.apply(summed, changed)
    states = [{k: v.clone() for k, v in m[1].state_dict().items()} for m in models]
    for other in states[1:]:
        if any(not torch.equal(other[k], states[0][k]) for k in states[0]):
            raise AssertionError(f"members of one step disagree: {members}")
    return states[0], summed


def batchnorm_buffers(section: Any, device: str) -> None:
    """BatchNorm's running statistics kept in step on the device, at 1, 2 and 3 members."""
    checks = section.checks
    results = [_step(members, device) for members in SPLITS]
    first, summed = results[0]
    checks["buffers_members_agree"] = all(
        torch.equal(state[k].cpu(), first[k].cpu()) for state, _ in results for k in first
    )
    # The CPU's mean of the same rows (the running mean: the first 8 of each row).
    width = summed.numel() // N_MICRO
    rows = summed.cpu().reshape(N_MICRO, width)[:, :8]
    total = rows[0].clone()
    for mb in range(1, N_MICRO):
        total += rows[mb]
    cpu_mean = (total / N_MICRO).to(torch.float32)
    checks["buffers_device_mean_is_cpu"] = torch.equal(first["running_mean"].cpu(), cpu_mean)
    section.details["batches_tracked"] = int(first["num_batches_tracked"])
