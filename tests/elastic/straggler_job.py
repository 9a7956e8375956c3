"""The job test_straggler.py launches: a small MLP with dropout whose member named by
``--slow`` works ``--factor`` times longer per micro-batch than the others (a sleep in the
loop body, which is what a member's compute seconds count: step.py)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--balance", default="off")
    parser.add_argument("--slow", default="", help="the member that works longer")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds per micro-batch")
    parser.add_argument("--factor", type=float, default=4.0, help="the slow member's x")
    parser.add_argument("--shard", default=None, help="zero1 or zero2")
    parser.add_argument("--muon", action="store_true", help="Muon for the matrices")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1)]
    if args.muon:  # matrices enough for Newton-Schulz work to spread over three members
        layers += [nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(32, 1))
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.muon:
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        optimizer = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    job = keepstep.init(model, optimizer, data, balance=args.balance, shard=args.shard)
    slow = os.environ.get("KEEPSTEP_MEMBER") == args.slow
    pause = args.pause * (args.factor if slow else 1.0)
    for step in job.steps():
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            time.sleep(pause)
            step.backward(loss)
        step.commit()
    zero = job.sharded.zero if job.sharded is not None else None
    if zero is not None and zero.designated:  # who stepped each matrix whole at the end
        shapes = {t: list(p.shape) for t, p in enumerate(job.params)}
        mine = [shapes[t] for t, r in zero.designated.items() if r == zero.rank]
        print("DESIGNATED " + json.dumps(mine), flush=True)


if __name__ == "__main__":
    main()
