"""The job test_hyper.py launches: a model whose lr ReduceLROnPlateau cuts, stepped with the
step's loss (``--metric shared``: the global batch's mean, the same on every member) or with
this member's own micro-batches' loss (``--metric own``: each member's differs); prints its
final lr and hashes."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--metric", choices=("shared", "own"), required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True) + 0.5 * torch.randn(512, 1, generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    # patience=0: every step whose loss is not a new best halves the lr.
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    job = keepstep.init(model, optimizer, data, state={"sched": sched}, metrics=("loss",))
    lrs = []
    for step in job.steps():
        own = []
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            step.log(loss=loss)
            own.append(loss.item())
            step.backward(loss)
        if result := step.commit():
            metric = result.metrics["loss"] if args.metric == "shared" else sum(own) / len(own)
            sched.step(metric)
            lrs.append(optimizer.param_groups[0]["lr"])
    print(f"lrs={lrs}")
    print(f"done steps={job.done} params_sha256={job.params_sha256()}")


if __name__ == "__main__":
    main()
