"""The end-to-end section of bench/gpu_check.py: a one-member keepstep job trained on the
device as a user's script would (`keepstep.device()`, `keepstep.init`, the step loop),
twice, each in a fresh process, which must end with the same parameters bit for bit.

Where it sits: gpu_check_more.run calls `job_end_to_end(section, device)`; it starts this
file as a child (`--child --device D`), which prints one JSON line. The model is
gpu_check's small transformer (embedding, SDPA with dropout, bf16 autocast on CUDA), with
AdamW, clipping and the exact reduction, so the child covers the job's own path on the
device: the reducer's fused ops (compiled on CUDA), keyed CUDA RNG per micro-batch, the
snapshot of device tensors at every commit, clipping of the reduced gradient.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEED = 6, 16, 4, 11
CHILD_TIMEOUT_S = 240
# (device, shard) -> a finished child's line: the ZeRO section compares with the unsharded
# job this section ran, instead of training it a third time.
FIRST_RUNS: dict[tuple[str, str], dict[str, Any]] = {}


def job_end_to_end(section: Any, device: str) -> None:
    """A one-member job on the device, twice in fresh processes: same parameter bits

    Each child trains STEPS steps of GLOBAL_BATCH sequences in micro-batches of
    MICRO_BATCH and prints its params_sha256, the reducer's path and seconds per step."""
    runs = [child(device) for _ in range(2)]
    FIRST_RUNS[device, "none"] = runs[0]
    section.details["runs"] = runs
    trained = all(r.get("done") == STEPS and math.isfinite(r.get("loss", math.nan)) for r in runs)
    section.checks["job_trains"] = trained
    section.checks["job_fresh_process_equal"] = trained and (
        runs[0]["params_sha256"] == runs[1]["params_sha256"]
    )
    if trained:
        section.figures["job_step_s"] = min(r["step_s"] for r in runs)


def child(device: str, shard: str = "none") -> dict[str, Any]:
    """One child's JSON line, or its exit code and the end of its stderr; ``shard``:
    "none", or the job's ``shard=`` (gpu_check_zero.py)."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--device", device, "--shard", shard],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"returncode": done.returncode, "stderr": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def train(device_name: str, shard: str = "none") -> dict[str, Any]:
    """The user's script: a one-member job on ``device_name`` (its optimizer state sharded
    when ``shard`` is "zero1" or "zero2"); its figures as a dict."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import keepstep
    from gpu_check import SEQ, VOCAB, Tiny  # beside this file

    device = keepstep.device() if device_name == "cuda" else torch.device("cpu")
    torch.manual_seed(1337)  # the initial weights
    model = Tiny().to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(2))
    job = keepstep.init(
        model, optimizer, TensorDataset(tokens), GLOBAL_BATCH, MICRO_BATCH, SEED,
        clip_grad_norm=1.0, shard=None if shard == "none" else shard,
    )  # fmt: skip
    cuda = device.type == "cuda"
    loss = torch.zeros(())
    started = time.perf_counter()
    for step in job.steps(STEPS):
        for mb in step.micro_batches():
            (batch,) = mb.data
            batch = batch.to(device)
            with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            step.backward(loss)
        step.commit()
    if cuda:
        torch.cuda.synchronize()
    return {
        "done": job.done,
        "loss": float(loss),
        "params_sha256": job.params_sha256(),
        "reducer_path": getattr(job.reducer, "path", None),
        "params_device": str(next(model.parameters()).device),
        "shard": shard,
        "step_s": (time.perf_counter() - started) / STEPS,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--child", action="store_true", help="train once, print one JSON line")
    parser.add_argument("--shard", choices=["none", "zero1", "zero2"], default="none")
    args = parser.parse_args()
    if not args.child:
        parser.error("run by gpu_check.py (python3 bench/gpu_check.py); --child trains once")
    print(json.dumps(train(args.device, args.shard)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
