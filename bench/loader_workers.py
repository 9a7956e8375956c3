"""Reading micro-batches in worker processes vs the training thread and reader threads.

One member trains a small MLP on a dataset whose reads are Python-heavy (a per-sample
loop that holds the GIL, as decoding and augmentation in Python do) and draw from the
global generators (a random flip and noise). It prints, per way of reading, the samples
per second and the parameters' hash: in the training thread (prefetch=0), on reader
threads (prefetch=4; their reads cannot be keyed, so that run reads a variant that draws
from a generator seeded by the index), and in 1 and 2 worker processes
(``loader_workers``), whose hashes must equal the training thread's.

    scripts/env python bench/loader_workers.py [--steps 12] [--work 20000]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

import keepstep


class Decoded(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples whose read costs ``work`` Python operations; ``keyed``: draws from the
    global generators (else from a generator seeded by the index)."""

    def __init__(self, work: int, keyed: bool, n: int = 4096) -> None:
        self.work, self.keyed, self.n = work, keyed, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = 0
        for k in range(self.work):  # the GIL-bound part of a decode
            acc = (acc * 31 + k + i) % 1_000_003
        base = torch.full((64,), float(acc % 97) / 97.0)
        if self.keyed:
            flip, noise = random.random() < 0.5, torch.randn(64)
        else:
            g = torch.Generator().manual_seed(i)
            flip, noise = bool(torch.rand(1, generator=g) < 0.5), torch.randn(64, generator=g)
        x = (-base if flip else base) + 0.1 * noise
        return x, x.sum(0, keepdim=True)


def run(steps: int, work: int, keyed: bool, prefetch: int, workers: int) -> tuple[float, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 1))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job = keepstep.init(model, optimizer, Decoded(work, keyed), 64, 8, seed=5, env={},
                        prefetch=prefetch, loader_workers=workers)  # fmt: skip
    start = None
    for step in job.steps(steps + 1):
        if step.index == 1:
            start = time.perf_counter()  # step 0 warms up (workers' first reads, allocator)
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    assert start is not None
    return steps * 64 / (time.perf_counter() - start), job.params_sha256()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--work", type=int, default=20000, help="Python operations a read")
    args = parser.parse_args()
    thread_s, thread_sha = run(args.steps, args.work, True, 0, 0)
    threads_s, _ = run(args.steps, args.work, False, 4, 0)
    one_s, one_sha = run(args.steps, args.work, True, 0, 1)
    two_s, two_sha = run(args.steps, args.work, True, 0, 2)
    print(json.dumps({
        "work_per_sample": args.work,
        "samples_per_s": {"training_thread": round(thread_s, 1),
                          "reader_threads_prefetch4": round(threads_s, 1),
                          "workers_1": round(one_s, 1), "workers_2": round(two_s, 1)},
        "speedup_workers_2": round(two_s / thread_s, 2),
        "same_bits_as_training_thread": one_sha == thread_sha == two_sha,
    }, indent=1))  # fmt: skip
    if not one_sha == thread_sha == two_sha:
        raise SystemExit("the workers' batches changed the parameters")


if __name__ == "__main__":
    main()
