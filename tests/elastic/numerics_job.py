"""The job test_numerics_agreement.py launches: a small MLP whose member named by
``--other`` reports another CPU model in its numerics fingerprint, as a member on a node
of another kind would; the member named by ``--compiled`` compiles the model."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import numerics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", default="", help="the member on another kind of CPU")
    parser.add_argument("--mode", default="exact")
    parser.add_argument("--compiled", default="", help="the member that compiles the model")
    args = parser.parse_args()
    me = os.environ.get("KEEPSTEP_MEMBER")
    if me == args.other:
        numerics._cpu_model = lambda: "Another CPU 9000"  # what /proc/cpuinfo would say there

    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 6, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    if me == args.compiled:  # e.g. compiled only where a GPU of some kind is found
        model.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    job = keepstep.init(model, optimizer, data, mode=args.mode)
    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()


if __name__ == "__main__":
    main()
