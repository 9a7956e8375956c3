"""The small model, optimizer and data the API's tests train, and a plain run of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 6, generator=g)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), TensorDataset(x, y)


def train(steps: int, **kw: object) -> tuple[str, list[float]]:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env={}, **kw)
    losses = []
    for step in job.steps(steps):
        total = 0.0
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            step.backward(loss)
            total += loss.item()
        assert step.commit()
        losses.append(total / len(step.micro_batch_ids))
    return job.params_sha256(), losses
