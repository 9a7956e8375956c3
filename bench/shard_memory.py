"""Memory per member with the optimizer state sharded (ZeRO-1) vs full replicas.

    scripts/env python bench/shard_memory.py [--members 2 4 8] [--d-model 128] [--layers 2]
        [--seq 64] [--vocab 256] [--steps 2]

Trains the example transformer (examples/transformer.py's TinyGPT, AdamW) for a few steps
with W members on threads of this process (one HashStore, the members named as one per
node, "n0/0", "n1/0", ...: the agents' naming, so replicas sit on other nodes), once with
full replicas and once with ``shard="zero1"``, and reads off each member:

    optimizer   bytes of optimizer state the member holds between steps (the storage
                behind its state tensors; sharded: its windows, ``ZeroOptimizer.state_bytes``)
    snapshot    bytes of the member's newest snapshot (parameters, buffers, the reducer's
                state, and the optimizer state: all of it, or its own chunks and a replica
                of another node's)

The ideal for the optimizer is 1/W of the full state; for the snapshot's optimizer part
2/W (its own chunks and one replica). The issue's target: optimizer memory per member
within 10% of 1/W plus the replicas. Figures are bytes, not times: a loaded machine gives
the same ones. A commit holds no more than the snapshot's pieces: each owner sends the
holders of its replicas their part, and nothing gathers the full state.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._C._distributed_c10d import HashStore

import keepstep
from keepstep.elastic import Job, ScheduleController
from keepstep.elastic.zero.optimizer import state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from transformer import CopyTask, TinyGPT


def _optimizer_bytes(job: Job) -> int:
    if job.sharded is not None and job.sharded.zero is not None:
        return job.sharded.zero.state_bytes()
    return state_bytes(job.optimizer)


def _train(args: argparse.Namespace, members: int, shard: str | None) -> list[dict[str, int]]:
    store, names = HashStore(), [f"n{i}/0" for i in range(members)]
    data = CopyTask(256, args.seq, args.vocab)
    jobs: list[tuple[Job, torch.nn.Module]] = []
    for me in names:  # built in one thread: the model's init draws from the global generator
        torch.manual_seed(0)
        model = TinyGPT(args.vocab, args.seq, args.d_model, args.layers, heads=4)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        controller = ScheduleController(store_=store, me=me, schedule=[names])
        # Two micro-batches of one sample per member.
        job = keepstep.init(
            model, opt, data, 2 * members, 1, 0, env={}, controller=controller, shard=shard
        )
        jobs.append((job, model))
    out: list[dict[str, int]] = [{} for _ in names]
    errors: list[BaseException] = []

    def member(i: int) -> None:
        job, model = jobs[i]
        try:
            for step in job.steps(args.steps):
                for mb in step.micro_batches():
                    logits = model(mb.inputs)
                    step.backward(F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten()))
                step.commit()
            out[i] = {
                "optimizer": _optimizer_bytes(job),
                "snapshot": job.snapshots.infos()[0].nbytes,
                "params": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
            job.snapshots.close()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"TinyGPT d={args.d_model} layers={args.layers} seq={args.seq} vocab={args.vocab}, "
        f"AdamW, {args.steps} steps; bytes per member (max over members)"
    )
    print(
        f"{'W':>3}  {'optimizer full':>14}  {'zero1':>12}  {'/full':>6}  {'ideal 1/W':>9}  "
        f"{'snapshot full':>13}  {'zero1':>12}  {'optim part /full':>16}  {'ideal 2/W':>9}"
    )
    rows: list[dict[str, Any]] = []
    for w in args.members:
        full, sharded = _train(args, w, None), _train(args, w, "zero1")
        opt_full = max(m["optimizer"] for m in full)
        opt_zero = max(m["optimizer"] for m in sharded)
        snap_full = max(m["snapshot"] for m in full)
        snap_zero = max(m["snapshot"] for m in sharded)
        # The snapshot's optimizer part: what it holds beyond a snapshot without optimizer
        # state (the full one less the full optimizer state).
        rest = snap_full - opt_full
        part = (snap_zero - rest) / opt_full
        print(
            f"{w:>3}  {opt_full:>14,}  {opt_zero:>12,}  {opt_zero / opt_full:>6.3f}  "
            f"{1 / w:>9.3f}  {snap_full:>13,}  {snap_zero:>12,}  {part:>16.3f}  "
            f"{min(1.0, 2 / w):>9.3f}"
        )
        rows.append({"w": w, "optimizer_ratio": opt_zero / opt_full, "snapshot_part": part})
    within = all(r["optimizer_ratio"] <= 1.1 / r["w"] for r in rows)
    print(f"optimizer per member within 10% of 1/W at every W: {within}")


if __name__ == "__main__":
    main()
