"""The training script `keepstep selfcheck` runs: a small MLP with dropout and LayerNorm,
clipped by global norm, logging its loss (both must be the same at every rank count).

It is a plain keepstep script (run as a file by the local launcher), kept inside the
package so the check works from an installed wheel without the repository's examples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 48), nn.LayerNorm(48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 1)
    )


def main() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1024, 12, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    job = keepstep.init(
        model, optimizer, TensorDataset(x, y), clip_grad_norm=0.5, metrics=("loss",)
    )
    for step in job.steps():
        for mb in step.micro_batches():
            loss = F.binary_cross_entropy_with_logits(model(mb.inputs), mb.targets)
            step.log(loss=loss)
            step.backward(loss)
        step.commit()


if __name__ == "__main__":
    main()
