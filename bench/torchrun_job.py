"""The restart-the-world reference job: examples/mlp.py under torchrun and plain DDP.

    python -m torch.distributed.run --nnodes 1 --nproc-per-node 4 --max-restarts 5 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT bench/torchrun_job.py \\
        --step-log LOG --checkpoint CKPT --global-batch 96 --micro-batch 4 --steps 200 [--sleep S]

Same model, data, optimizer and batch split as examples/mlp.py (micro-batch i of a step
reads the samples keepstep's SampleOrder gives it and runs under the same keyed RNG),
computed the way a torchrun user would: DistributedDataParallel over gloo, micro-batch i
on rank i % world, gradients accumulated under no_sync() and all-reduced once per step.
Fault tolerance is what torchrun offers: after every step rank 0 saves model and
optimizer (torch.save to a temporary file, then rename, so a kill never leaves half a
checkpoint), and every start resumes from that file. A worker that dies makes torchrun
stop and restart the whole group. bench/torchrun_baseline.py launches this and kills
workers.

The log gets one JSON line per event, with wall time `t` and torchrun's restart count:
`start` (process start, every rank), `ready` (process group up and checkpoint loaded,
every rank), `step` (rank 0, once the checkpoint of that step is renamed into place).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from keepstep.elastic.rng import SampleOrder, rng_scope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from harness.procs import process_start_time
from mlp import make_dataset, make_model


def log_line(path: str, event: str, **fields: Any) -> None:
    # One short write per line in append mode: lines from four ranks never interleave.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = {"event": event, "t": time.time(), "restart": restart, "pid": os.getpid(), **fields}
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def save_atomically(state: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.0, help="s per micro-batch, as mlp.py")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a worker is stuck
    log_line(args.step_log, "start", rank=rank, t_process=process_start_time())

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    n_micro = args.global_batch // args.micro_batch
    assert n_micro * args.micro_batch == args.global_batch, "global batch = micro x n_micro"
    assert world <= n_micro, f"{world} ranks but only {n_micro} micro-batches"
    base = make_model()
    optimizer = torch.optim.AdamW(base.parameters(), lr=3e-3)
    ckpt = Path(args.checkpoint)
    start = 0
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        base.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = DistributedDataParallel(base)
    dataset = make_dataset()
    order = SampleOrder(args.seed, len(dataset), args.micro_batch, n_micro)
    mine = list(range(rank, n_micro, world))
    log_line(args.step_log, "ready", rank=rank, step=start)

    for step in range(start, args.steps):
        for k, mb in enumerate(mine):
            x, y = dataset[order.indices(step, mb)]
            last = k == len(mine) - 1
            # DDP averages over ranks; scaling by world / n_micro makes it a mean over
            # all micro-batches of the step, as keepstep's constant divisor does.
            with contextlib.nullcontext() if last else model.no_sync():
                with rng_scope(args.seed, step, mb):
                    loss = F.mse_loss(model(x), y)
                (loss * world / n_micro).backward()
            time.sleep(args.sleep)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            state = {
                "step": step + 1,
                "model": base.state_dict(),
                "optimizer": optimizer.state_dict(),
            }
            save_atomically(state, ckpt)
            log_line(args.step_log, "step", step=step + 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
