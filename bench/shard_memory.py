"""Memory per member with the optimizer state sharded (ZeRO-1, ZeRO-2) vs full replicas.

    scripts/env python bench/shard_memory.py [--members 2 4 8] [--d-model 128] [--layers 2]
        [--seq 64] [--vocab 256] [--steps 2]

Trains the example transformer (examples/transformer.py's TinyGPT, AdamW) for a few steps
with W members on threads of this process (one HashStore, the members named as one per
node, "n0/0", "n1/0", ...: the agents' naming, so replicas sit on other nodes), once with
full replicas, once with ``shard="zero1"`` and once with ``shard="zero2"``, and reads off
each member:

    optimizer   bytes of optimizer state the member holds between steps (the storage
                behind its state tensors; sharded: its windows, and ZeRO-1's replicas,
                ``ShardedOptimizer.state_bytes``)
    gradient    bytes of the reduced gradient the member holds for the optimizer step
                (the parameters' ``.grad``; ZeRO-2: its windows' gradients only)
    snapshot    bytes of the member's newest snapshot (parameters, buffers, the reducer's
                state, and the optimizer state: all of it, or its own chunks and a replica
                of another node's)

The ideal for the optimizer is 1/W of the full plus the replicas it holds live: ZeRO-2
1/W (and 1/W of the gradient), ZeRO-1 2/W, since it steps the one replica it keeps
instead of receiving it at every commit; for the snapshot's optimizer part 2/W (its own
chunks and one replica). The issue's target: optimizer memory per member within 10% of
1/W plus the replicas. Figures are bytes, not times: a loaded machine gives the same
ones. Nothing gathers the full state.
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
from keepstep.elastic.zero.optimizer import ZeroOptimizer, state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from transformer import CopyTask, TinyGPT


def _optimizer_bytes(job: Job) -> int:
    if job.sharded is not None and job.sharded.zero is not None:
        return job.sharded.state_bytes()  # its shard's, and (ZeRO-1) the replicas it steps
    return state_bytes(job.optimizer)


_GRADS: dict[int, int] = {}  # per thread: the largest reduced gradient held for a step


def _grad_bytes(grads: Any) -> int:
    return sum(g.numel() * g.element_size() for g in grads if g is not None)


def _watch_gradients() -> None:
    """Record, per member thread, the reduced gradient each optimizer step is handed: the
    parameters' ``.grad`` when the job applies the update, or ZeRO-2's windows' gradients."""
    apply, attach = Job.apply_update, ZeroOptimizer.attach_grads

    def seen(n: int) -> None:
        me = threading.get_ident()
        _GRADS[me] = max(_GRADS.get(me, 0), n)

    def apply_update(job: Job, index: int) -> float | None:
        seen(_grad_bytes(p.grad for p in job.params))
        return apply(job, index)

    def attach_grads(zero: ZeroOptimizer, grads: Any, given: Any = None) -> None:
        seen(_grad_bytes(grads))
        attach(zero, grads, given)

    Job.apply_update = apply_update  # type: ignore[method-assign]
    ZeroOptimizer.attach_grads = attach_grads  # type: ignore[method-assign]


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
                "gradient": _GRADS.pop(threading.get_ident(), 0),
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
    _watch_gradients()
    print(
        f"TinyGPT d={args.d_model} layers={args.layers} seq={args.seq} vocab={args.vocab}, "
        f"AdamW, {args.steps} steps; bytes per member (max over members), and each one's "
        "ratio to full replicas' (ideal: optimizer 1/W plus live replicas, ZeRO-1 2/W; "
        "snapshot's optimizer part 2/W)"
    )
    print(
        f"{'W':>3}  {'mode':<5}  {'optimizer':>12}  {'/full':>6}  {'gradient':>12}  {'/full':>6}  "
        f"{'snapshot':>12}  {'optim part /full':>16}"
    )
    rows: list[dict[str, Any]] = []
    for w in args.members:
        full = _train(args, w, None)
        opt_full = max(m["optimizer"] for m in full)
        grad_full = max(m["gradient"] for m in full)
        # The snapshot's optimizer part: what it holds beyond a snapshot without optimizer
        # state (the full one less the full optimizer state).
        rest = max(m["snapshot"] for m in full) - opt_full
        for mode in ("full", "zero1", "zero2"):
            found = full if mode == "full" else _train(args, w, mode)
            opt = max(m["optimizer"] for m in found)
            grad = max(m["gradient"] for m in found)
            snap = max(m["snapshot"] for m in found)
            part = (snap - rest) / opt_full
            print(
                f"{w:>3}  {mode:<5}  {opt:>12,}  {opt / opt_full:>6.3f}  {grad:>12,}  "
                f"{grad / grad_full:>6.3f}  {snap:>12,}  {part:>16.3f}"
            )
            ideal = (2 if mode == "zero1" else 1) / w  # ZeRO-1 steps its replica live
            rows.append({"mode": mode, "optimizer_ratio": opt / opt_full, "ideal": ideal})
    within = all(r["optimizer_ratio"] <= 1.1 * r["ideal"] for r in rows if r["mode"] != "full")
    print(f"sharded optimizer per member within 10% of 1/W plus the replicas at every W: {within}")


if __name__ == "__main__":
    main()
