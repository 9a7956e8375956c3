"""The job test_optimizer_group.py launches: a small decoder-style model whose matrices
Muon steps and whose embedding, norms, biases and head AdamW steps, each optimizer with its
own tracked LR scheduler, with dropout; prints its final hashes. With KEEPSTEP_SHARD set,
both optimizers are sharded (zero/muon.py for Muon); ``--die-in-alltoall MEMBER:STEP``:
that member SIGKILLs itself as its sharded step of STEP starts Muon's all-to-all (its
momentum already moved, the others waiting in it)."""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic.sharded import CommGather

VOCAB, WIDTH, LENGTH = 32, 16, 6


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(self.drop(F.gelu(self.up(self.norm(h)))))
        return self.head(h.mean(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--die-in-alltoall", default="", help="MEMBER:STEP")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (512, LENGTH), generator=g)
    data = TensorDataset(tokens, tokens.sum(1) % VOCAB)
    torch.manual_seed(0)
    model = Model()
    hidden = [model.up.weight, model.down.weight]  # Muon: the hidden matrices only
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95)
    adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)
    schedules = {
        "muon_sched": torch.optim.lr_scheduler.StepLR(muon, step_size=3, gamma=0.5),
        "adamw_sched": torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 4)),
    }
    job = keepstep.init(model, [muon, adamw], data, state=schedules, clip_grad_norm=1.0)
    member, _, at = args.die_in_alltoall.partition(":")
    if member and member == os.environ.get("KEEPSTEP_MEMBER"):
        send = CommGather.alltoall

        def dying(self: CommGather, sends: Any, max_bytes: int, timeout: timedelta) -> Any:
            if job.done == int(at):  # inside the step: its momentum moved, not committed
                os.kill(os.getpid(), signal.SIGKILL)
            return send(self, sends, max_bytes, timeout)

        CommGather.alltoall = dying  # type: ignore[method-assign]
    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.cross_entropy(model(mb.inputs), mb.targets))
        if step.commit():
            for sched in schedules.values():
                sched.step()
    moments = sum(int(s["momentum_buffer"].count_nonzero()) for s in muon.state.values())
    # Under ZeRO the shards hold the state (muon.state is empty): the gathered state's hash
    # is what compares.
    print(
        f"done steps={job.done} muon_moments={moments} optim_sha256={job.optimizer_sha256()} "
        f"params_sha256={job.params_sha256()}"
    )


if __name__ == "__main__":
    main()
