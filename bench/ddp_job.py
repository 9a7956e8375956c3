"""The benchmark workload under plain DistributedDataParallel (gloo); with --checkpoint, the
torchrun restart-the-world job.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python bench/ddp_job.py \\
        <workload flags> --log-dir DIR [--save PATH] [--checkpoint PATH]

Micro-batch i of a step runs on rank i % world, gradients are accumulated under
`no_sync()` and all-reduced once per step (in the last backward); each loss is scaled by
world / n_micro, so DDP's average over ranks is the mean over all n_micro micro-batches,
the same global batch and gradient scale as keepstep's constant divisor, whatever the
world size. With --checkpoint (what a torchrun user does for fault tolerance) rank 0
saves model and optimizer after every step, to a temporary file renamed into place so a
kill never leaves half of one, and every start resumes from it. A generation is one start
of the group: rank 0's wall time at the start, broadcast to the others.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from harness import workload
from harness.config import add_workload_args, workload_from
from harness.procs import process_start_time
from harness.steplog import StepLog
from keepstep.elastic.rng import rng_scope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--save", help="final parameters (torch.save) from rank 0")
    parser.add_argument("--checkpoint", help="save every step here and resume from it")
    args = parser.parse_args()
    w = workload_from(args)
    rank = int(os.environ["RANK"])
    # BENCH_NODE names the simulated node (one torchrun agent each); plain DDP has ranks.
    log = StepLog(Path(args.log_dir), f"node{os.environ.get('BENCH_NODE', rank)}")
    log.event("start", t_process=process_start_time())
    workload.setup_process()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    gen = [time.time()]
    dist.broadcast_object_list(gen, src=0)
    assert world <= w.n_micro, f"{world} ranks but only {w.n_micro} micro-batches"

    base, optimizer, data = workload.build(w)
    start = 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        base.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = DistributedDataParallel(base)
    order = workload.sample_order(w)
    mine = list(range(rank, w.n_micro, world))
    log.event("ready", gen=gen[0], step=start, world=world)

    for step in range(start, w.steps):
        t0 = time.time()
        loss_sum = 0.0
        for k, mb in enumerate(mine):
            x, y = workload.batch(data, order, step, mb)
            last = k == len(mine) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with rng_scope(w.seed, step, mb):
                    loss = workload.loss_of(model, x, y)
                    loss_sum += loss.item()
                    if last:  # before the backward that all-reduces
                        log.work(gen[0], step, step, mine, loss_sum, t0)
                    (loss * world / w.n_micro).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            if ckpt is not None:
                state = {
                    "step": step + 1,
                    "model": base.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }
                tmp = ckpt.with_name(ckpt.name + ".tmp")
                torch.save(state, tmp)
                tmp.replace(ckpt)
            log.commit(gen[0], step, None, world, t0)
    if rank == 0 and args.save:
        workload.save_params(base, args.save)
    dist.destroy_process_group()
    log.close()


if __name__ == "__main__":
    main()
