"""The MLP of mlp.py with the state real scripts carry: an LR warmup + cosine schedule,
gradient clipping, an EMA of the weights, a progress counter and a cursor into a data
stream of the script's own, kept by keepstep.

Everything a step advances besides the parameters is tracked with the job, so it is in
every snapshot: it rolls back with them, reaches a restarted worker or a joiner, and is
part of the hash every member reports. The rule: advance it after `if step.commit():`.

    scripts/env python examples/scheduled.py --global-batch 48 --micro-batch 4 --steps 30

`--amp bf16|fp16` runs the forward under CPU autocast (the parameters stay float32).
`--grad-scaler` scales the loss with a GradScaler that the job drives (`grad_scaler=`):
it unscales the reduced gradient before clipping and skips a step whose gradient
overflowed, on every member alike, as torch's AMP recipe does. fp16 turns it on.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import keepstep
from mlp import make_dataset, make_model  # the same model and data as mlp.py


class Progress:
    """The script's own counters; anything with state_dict/load_state_dict can be tracked."""

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.clipped = 0  # steps whose gradient norm was over the clip
        self.skipped = 0  # steps the loss scaling skipped (their gradient overflowed)

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("steps", "samples", "clipped", "skipped")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


class StreamCursor:
    """Where the script is in a stream it reads on its own (held-out batches to evaluate
    on, say): a position that wraps around the stream, counting the passes."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.position = 0
        self.passes = 0

    def advance(self, samples: int) -> None:
        self.position += samples
        while self.position >= self.length:
            self.position -= self.length
            self.passes += 1

    def state_dict(self) -> dict[str, int]:
        return {"length": self.length, "position": self.position, "passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.length, self.position, self.passes = (
            state["length"],
            state["position"],
            state["passes"],
        )


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        done = min(1.0, (i - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--clip", type=float, default=0.5, help="max global gradient norm")
    parser.add_argument("--grad-scaler", action="store_true", help="scale the loss")
    parser.add_argument("--amp", choices=("bf16", "fp16"), help="autocast the forward")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per micro-batch (demos)")
    args = parser.parse_args()

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    progress = Progress()
    cursor = StreamCursor(length=1000)  # a length no multiple of the batch: it wraps unevenly
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or "")
    # float16's range needs loss scaling; the job unscales, skips and updates the scale.
    use_scaler = args.grad_scaler or amp is torch.float16
    # The first fp16 steps are often skipped while the scale comes down from its start; the
    # schedule still follows the step index, as in torch's AMP recipe, and torch's warning
    # that the optimizer has not stepped yet is expected then.
    warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before")
    scaler = torch.amp.GradScaler("cpu", growth_interval=3) if use_scaler else None
    job = keepstep.init(
        model,
        optimizer,
        make_dataset(),
        args.global_batch,
        args.micro_batch,
        args.seed,
        clip_grad_norm=args.clip,
        state={"ema": ema, "progress": progress, "cursor": cursor},
        grad_scaler=scaler,
    )
    total = args.steps if args.steps is not None else job.config.planned_steps or 1
    # Built after init, which knows the step count a launcher set: then tracked by name.
    sched = job.track("sched", LambdaLR(optimizer, warmup_cosine(max(1, total // 5), total)))

    for step in job.steps(args.steps):
        for mb in step.micro_batches():
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = F.mse_loss(model(mb.inputs), mb.targets)
            step.backward(scaler.scale(loss) if scaler is not None else loss)
            time.sleep(args.sleep)
        result = step.commit()
        if result:  # only a committed step advances what the job tracks
            sched.step()
            ema.update_parameters(model)
            progress.steps += 1
            progress.skipped += int(result.skipped)
            progress.samples += job.config.global_batch
            progress.clipped += int((result.grad_norm or 0.0) > args.clip)
            cursor.advance(job.config.global_batch)
            if job.is_leader and step.index % 10 == 0:
                print(f"step {step.index} lr {optimizer.param_groups[0]['lr']:.5f}", flush=True)
    if not job.left:
        # Every member that trained to the end prints its hashes: they must all agree.
        names = " ".join(f"{n}={job.state_sha256(n)}" for n in job.tracked.names)
        print(
            f"final steps={job.done} clipped={progress.clipped} "
            f"params_sha256={job.params_sha256()} {names}",
            flush=True,
        )


if __name__ == "__main__":
    main()
