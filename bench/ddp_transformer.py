"""The speed reference: the example transformer under plain DistributedDataParallel (gloo).

Same model, data, global batch and micro-batch split as keepstep's exact mode, with
gradient accumulation under `no_sync()` and one float all-reduce per step. Launched by
bench/step_time.py with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; writes the
per-step wall times as JSON to the path in argv[1].
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from transformer import CopyTask, TinyGPT


def main() -> None:
    out, steps, gb, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    d, layers, seq = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(128, seq, d, layers, max(1, d // 64)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CopyTask(4096, seq, 128)
    n_micro = gb // mb
    mine = [i for i in range(n_micro) if i % world == rank]
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for k, i in enumerate(mine):
            base = (step * n_micro + i) * mb
            x, y = zip(*(data[(base + j) % len(data)] for j in range(mb)), strict=True)
            sync = k == len(mine) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(torch.stack(x))
                loss = F.cross_entropy(logits.flatten(0, 1), torch.stack(y).flatten())
                (loss * world / n_micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_seconds": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
