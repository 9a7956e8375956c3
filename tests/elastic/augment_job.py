"""The job test_augment.py launches: a dataset whose __getitem__ augments at random with
torch's, ``random``'s and numpy's global generators, as torchvision-style transforms do,
and a loop body that draws a loss weight per step outside its micro-batches; prints its
final hashes. ``--workers N`` reads the micro-batches in N forked processes."""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import keepstep


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed samples, read with noise, a random sign flip and a random scale."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(8)
        if random.random() < 0.5:
            x = -x
        return x * float(np.random.uniform(0.9, 1.1)), self.y[i]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=0, help="loader_workers (0: in-thread)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(model, optimizer, Augmented(), loader_workers=args.workers)
    for step in job.steps():
        weight = random.choice([0.5, 1.0, 2.0])  # a per-step random choice, outside
        for mb in step.micro_batches():
            step.backward(weight * F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    print(f"done steps={job.done} params_sha256={job.params_sha256()}")


if __name__ == "__main__":
    main()
