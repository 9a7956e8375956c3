"""The job test_shard_zero_job.py launches: a small MLP with dropout trained with AdamW, its
optimizer state sharded when ``--shard zero1`` is given. Beside the launcher's result file
each finishing member writes ``<result>.optim``: the full optimizer state's sha256, and
with ``--shard`` the elements its shard owns and the bytes of optimizer state it steps.
``--die-in-gather MEMBER:STEP``: that member SIGKILLs itself when its sharded step of STEP
starts its parameter all-gather (its own shard already stepped, the others waiting in it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic.sharded import CommGather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default=None)
    parser.add_argument("--die-in-gather", default="", help="MEMBER:STEP")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    torch.manual_seed(0)
    # 8*96+96 + 96*33+33 + 33+1 parameters: no size divides evenly into 128-element shards.
    model = nn.Sequential(
        nn.Linear(8, 96), nn.ReLU(), nn.Dropout(0.1), nn.Linear(96, 33), nn.Tanh(), nn.Linear(33, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    job = keepstep.init(model, optimizer, data, shard=args.shard)
    member, _, at = args.die_in_gather.partition(":")
    if member and member == os.environ.get("KEEPSTEP_MEMBER"):
        gather = CommGather.allgather

        def dying(self: CommGather, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
            if job.done == int(at):  # inside apply_update: the step is not counted yet
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(self, mine, timeout)

        CommGather.allgather = dying  # type: ignore[method-assign]
    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    result = os.environ.get("KEEPSTEP_RESULT")
    if result and not job.left:
        zero = job.sharded.zero if job.sharded is not None else None
        figures = {
            "optimizer_sha256": job.optimizer_sha256(),
            "owned_elements": zero.owned_elements() if zero is not None else None,
            "shard_state_bytes": zero.state_bytes() if zero is not None else None,
        }
        Path(result + ".optim").write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
