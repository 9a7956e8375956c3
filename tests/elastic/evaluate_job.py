"""The job test_evaluate.py launches: trains with dropout and BatchNorm, and every second
step evaluates a held-out set split across the members (``job.evaluate``), printing the
totals; with ``EVAL_KILL=member:flag_file`` that member SIGKILLs itself in the middle of
its first evaluation at step 3, so the others' all-reduce loses it."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep


def pairs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def main() -> None:
    logging.getLogger("keepstep.elastic.evaluate").addHandler(logging.StreamHandler())
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    job = keepstep.init(model, optimizer, pairs(512, seed=1))
    held_out = pairs(100, seed=2)  # 13 batches of 8, the last of 4
    victim, _, flag = os.environ.get("EVAL_KILL", "::").partition(":")

    def loss_sum(batch: list[torch.Tensor]) -> dict[str, object]:
        x, y = batch
        if os.environ["KEEPSTEP_MEMBER"] == victim and job.done == 4 and not Path(flag).exists():
            Path(flag).touch()
            time.sleep(1.0)  # the others are through the commit, in evaluate's all-reduce
            os.kill(os.getpid(), signal.SIGKILL)
        assert not model.training and not torch.is_grad_enabled()
        return {"loss": F.mse_loss(model(x), y, reduction="sum"), "count": len(y)}

    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        if step.commit() and step.index % 2 == 1:
            totals = job.evaluate(held_out, loss_sum, names=("loss", "count"), batch_size=8)
            assert model.training  # as it was
            print(f"eval step={step.index} loss={totals['loss'].hex()} count={totals['count']}")
    print(f"done steps={job.done} params_sha256={job.params_sha256()}")


if __name__ == "__main__":
    main()
