"""The job test_slow_node_run.py and bench/straggler_run.py launch: a small MLP whose every
micro-batch also burns a fixed amount of CPU (``--work`` rounds of a matrix product whose
result is dropped), so that a node slowed by a CPU quota or a SIGSTOP duty cycle computes
slower. The extra work touches no parameter: the numbers are those of the plain MLP."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def burn(rounds: int) -> float:
    """CPU work of a fixed size: `rounds` products of a 256x256 matrix (about 1 ms each)."""
    a = torch.full((256, 256), 0.01)
    for _ in range(rounds):
        a = torch.tanh(a @ a)
    return float(a[0, 0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=int, default=30, help="matrix products per micro-batch")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per worker: a quota slows it as it says

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1024, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(model, optimizer, data, metrics=("loss",))
    for step in job.steps():
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            burn(args.work)
            step.backward(loss)
            step.log(loss=loss)
        step.commit()
    if job.is_leader:
        print(f"done steps={job.done} params_sha256={job.params_sha256()}", flush=True)


if __name__ == "__main__":
    main()
