"""What a real script's extras cost per step: tracked state, clipping, step.log, prefetch.

One member, the example transformer (examples/transformer.py's TinyGPT), the same steps
with one extra at a time, in interleaved rounds (machine drift hits every variant alike);
prints each variant's median step time and its cost against the plain loop. Then the
prefetch speed-up with a dataset whose reads cost about one micro-batch's compute (a
sleep per sample: I/O or decoding that releases the GIL), with and without `prefetch`.

    scripts/env python bench/script_costs.py [--steps 30] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

import keepstep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from transformer import CopyTask, TinyGPT

VOCAB, SEQ, D, LAYERS, HEADS = 128, 128, 128, 2, 4
GB, MB = 16, 4


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class SlowReads(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The example's data, each read taking `delay` seconds."""

    def __init__(self, inner: CopyTask, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.inner[i]


def step_times(variant: str, steps: int, delay: float = 0.0) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, D, LAYERS, HEADS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data: Any = CopyTask(1024, SEQ, VOCAB)
    kw: dict[str, Any] = {}
    if variant == "state":
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
        kw["state"] = {"ema": ema, "counter": Counter()}
    if variant == "clip":
        kw["clip_grad_norm"] = 1.0
    if variant == "log":
        kw["metrics"] = ("loss",)
    if variant.startswith("reads"):
        data = SlowReads(data, delay)
        kw["prefetch"] = GB // MB if variant == "reads+prefetch" else 0
    job = keepstep.init(model, opt, data, GB, MB, 1, env={}, **kw)
    sched = job.track("sched", LambdaLR(opt, lambda i: 1.0)) if variant == "state" else None
    out = []
    for step in job.steps(steps):
        t0 = time.perf_counter()
        for mb in step.micro_batches():
            loss = F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.targets.flatten())
            if variant == "log":
                step.log(loss=loss)
            step.backward(loss)
        if step.commit() and variant == "state":
            assert sched is not None
            sched.step()
            kw["state"]["ema"].update_parameters(model)
            kw["state"]["counter"].n += 1
        out.append(time.perf_counter() - t0)
    job.snapshots.close()
    return out[3:]  # the first steps allocate and warm the caches


def micro_batch_compute_s() -> float:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, D, LAYERS, HEADS)
    x, y = CopyTask(MB, SEQ, VOCAB).tokens[:, :-1], CopyTask(MB, SEQ, VOCAB).tokens[:, 1:]
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = ["plain", "state", "clip", "log"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v] += step_times(v, args.steps)
    base = statistics.median(times["plain"])
    costs = {
        v: {
            "step_ms": round(1e3 * statistics.median(times[v]), 2),
            "cost_pct": round(100 * (statistics.median(times[v]) / base - 1), 2),
        }
        for v in variants
    }
    compute = micro_batch_compute_s()
    delay = compute / MB  # a micro-batch's reads cost about its forward and backward
    reads = {
        v: statistics.median(step_times(v, args.steps, delay)) for v in ("reads", "reads+prefetch")
    }
    figures = {
        "model": f"TinyGPT d{D} L{LAYERS} seq{SEQ}, global batch {GB} = {GB // MB} x {MB}",
        "variants": costs,
        "prefetch": {
            "micro_batch_compute_ms": round(1e3 * compute, 2),
            "read_ms_per_micro_batch": round(1e3 * delay * MB, 2),
            "step_ms_reading_in_loop": round(1e3 * reads["reads"], 2),
            "step_ms_prefetching": round(1e3 * reads["reads+prefetch"], 2),
            "speedup": round(reads["reads"] / reads["reads+prefetch"], 2),
        },
    }
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
