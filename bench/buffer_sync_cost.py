"""What keeping BatchNorm's buffers in step costs (keepstep.elastic.buffers), beside a step.

A ResNet-like stack of convolutions with BatchNorm (every BatchNorm's running mean and
variance and batch counter change in each training forward). For one member that computes
every micro-batch of a step, prints the median seconds of: one micro-batch's forward and
backward; the buffer bookkeeping of a whole step (the copy at its start, the comparison
after each micro-batch, the rows to sum and the mean at commit, without the all-reduce);
and the bytes the all-reduce of the rows carries against the float64 gradient sum.

    scripts/env python bench/buffer_sync_cost.py [--blocks 16] [--width 64] [--n-micro 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from keepstep.elastic.buffers import BufferSync


def model(blocks: int, width: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)]
    for _ in range(blocks):
        layers += [nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--n-micro", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = model(args.blocks, args.width)
    x = torch.randn(args.micro_batch, 3, args.image, args.image)
    y = torch.randint(0, 10, (args.micro_batch,))
    sync = BufferSync(net, args.n_micro)
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    moved = [b for bn in bns for b in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    assert all(isinstance(b, torch.Tensor) for b in moved)

    def micro_batch() -> None:
        F.cross_entropy(net(x), y).backward()

    def bookkeeping() -> None:
        sync.begin_step()
        for mb in range(args.n_micro):
            for buf in moved:  # what a forward does to them, without the forward
                buf.add_(1)
            sync.end_micro_batch(mb)
        changed = [f > 0 for f in sync.flags()]
        sync.apply(sync.gather(changed, torch.device("cpu")), changed)

    step_s, sync_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.n_micro):
            micro_batch()
        step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bookkeeping()
        sync_s.append(time.perf_counter() - t0)
    changed = [f > 0 for f in sync.flags()]
    rows = sync.gather(changed, torch.device("cpu")).numel()
    params = sum(p.numel() for p in net.parameters())
    step, book = statistics.median(step_s), statistics.median(sync_s)
    print(
        json.dumps(
            {
                "batchnorm_layers": len(bns),
                "buffers": sync.count,
                "n_micro": args.n_micro,
                "step_compute_s": round(step, 4),
                "buffer_bookkeeping_s": round(book, 5),
                "bookkeeping_over_compute": round(book / step, 4),
                "rows_allreduce_bytes": rows * 8,
                "gradient_allreduce_bytes": params * 8,
            }
        )
    )


if __name__ == "__main__":
    main()
