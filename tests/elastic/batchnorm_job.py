"""The job test_buffers.py launches: an MLP with BatchNorm (running statistics and a batch
counter that every training forward updates) and dropout; prints its final hashes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def main() -> None:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(model, optimizer, data)
    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d) and bn.num_batches_tracked is not None
    counted = int(bn.num_batches_tracked)
    print(f"done steps={job.done} batches_tracked={counted} params_sha256={job.params_sha256()}")


if __name__ == "__main__":
    main()
