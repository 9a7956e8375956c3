"""The job test_straggler.py launches: a small MLP with dropout whose member named by
``--slow`` works ``--factor`` times longer per micro-batch than the others (a sleep in the
loop body, which is what a member's compute seconds count: step.py)."""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(model, optimizer, data, balance=args.balance)
    slow = os.environ.get("KEEPSTEP_MEMBER") == args.slow
    pause = args.pause * (args.factor if slow else 1.0)
    for step in job.steps():
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            time.sleep(pause)
            step.backward(loss)
        step.commit()


if __name__ == "__main__":
    main()
