"""A small MLP with dropout, trained elastically: the smallest keepstep job.

Run it alone (one member):
    scripts/env python examples/mlp.py --global-batch 64 --micro-batch 4 --steps 30
or under a launcher (`keepstep run`, `keepstep selfcheck`), which sets the job's numbers.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def make_dataset(n: int = 2048, dim: int = 16) -> TensorDataset:
    # A fixed synthetic regression task, the same in every process.
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def make_model(dim: int = 16, hidden: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(dim, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--save", help="write the final state dict here (from one member)")
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds of extra work per micro-batch (demos)"
    )
    args = parser.parse_args()

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(
        model,
        optimizer,
        make_dataset(),
        args.global_batch,
        args.micro_batch,
        args.seed,
        metrics=("loss",),
    )
    for step in job.steps(args.steps):
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            step.backward(loss)
            step.log(loss=loss)  # the step's mean loss: the run's summary and dashboard
            time.sleep(args.sleep)
        step.commit()
        if job.is_leader and step.index % 10 == 0:
            print(f"step {step.index} world {len(job.assignment)}", flush=True)
    if job.is_leader:
        print(f"done steps={job.done} params_sha256={job.params_sha256()}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
