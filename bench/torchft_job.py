"""The benchmark workload under TorchFT: one replica group (one process) per node.

    python bench/torchft_job.py <workload flags> --log-dir DIR --replica R --replicas 4 \\
        --lighthouse http://127.0.0.1:PORT --min-replicas 2 [--data loader|step] [--save P]

TorchFT as its DDP example uses it: torchft's Manager (gloo, its lighthouse), its
DistributedDataParallel and OptimizerWrapper around the same model, optimizer and
samples as the other systems. The data is sharded by replica group, as torchft's
DistributedSampler does: replica R computes micro-batches {i : i % replicas == R} of each
data step (so four replicas make keepstep's global batch). The gradient is averaged over
the replicas that take part in a step, so a missing replica shrinks the global batch.

`--data loader` (the default, torchft's example): each replica walks its shard with a
position of its own that advances every iteration, committed or not, and starts from 0
in a new process, since the sampler's position is not part of the state a recovering
replica fetches. `--data step`: the data step is the Manager's committed step instead
(a careful user's loop): a failed step is redone with the same samples, but a missing
replica's shard is still skipped. Either way the step log records what was trained.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

from harness import workload
from harness.config import add_workload_args, workload_from
from harness.procs import process_start_time
from harness.steplog import StepLog, read_records
from keepstep.elastic.rng import rng_scope


def wait_for_event(folder: Path, kind: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len({r["member"] for r in read_records(folder) if r["kind"] == kind}) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} replicas logged {kind} in {timeout:.0f} s")
        time.sleep(0.05)


def allreduce_grads(manager: Manager, model: torch.nn.Module) -> None:
    """Average the gradient over the step's participants through the Manager (errors are
    latched there and make the step uncommitted, as in torchft's DDP hook)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--replica", type=int, required=True, help="replica group = data shard")
    parser.add_argument("--replicas", type=int, required=True, help="shards (nodes at start)")
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--data", choices=["loader", "step"], default="loader")
    # torchft's example: 5 s for gloo collectives, 10 s for the Manager's RPCs.
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="gloo collectives (s)")
    parser.add_argument("--timeout", type=float, default=10.0, help="Manager RPCs (s)")
    parser.add_argument("--grad-sync", choices=["manager", "ddp"], default="manager")
    parser.add_argument("--save", help="final parameters (torch.save)")
    parser.add_argument(
        "--wait-for", type=int, default=0, help="start once this many replicas have started"
    )
    args = parser.parse_args()
    w = workload_from(args)
    member = f"replica{args.replica}"
    log = StepLog(Path(args.log_dir), member)
    log.event("start", t_process=process_start_time())
    logging.basicConfig(level=logging.WARNING)
    workload.setup_process()

    base, inner, data = workload.build(w)

    def load_state_dict(state: dict[str, Any]) -> None:
        base.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": base.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    # The replica group's own store (a group of one process): TorchFT's Manager expects
    # it to exist before it starts.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=member,
        hostname="127.0.0.1",
        # Every replica builds the same initial parameters (seeded), which is when
        # torchft's docs say to skip the step-0 sync (it would idle all but one replica).
        init_sync=False,
    )
    # torchft 0.2.0's DistributedDataParallel crashes the survivors when a peer dies in
    # the all-reduce on CPU (its comm hook asserts on a future the failed wait never set:
    # `assert fut._fut` in torchft/ddp.py), so by default the gradient goes through the
    # Manager's fault-tolerant allreduce directly, one flat buffer per step, which is what
    # that hook does; `--grad-sync ddp` runs torchft's wrapper to show the failure.
    if args.wait_for:
        # The initial replicas start together, as a job launcher starts them: each waits
        # until every one heartbeats, so the first quorum has all of them (the lighthouse
        # only waits for replicas it has heard from).
        log.event("manager-up")
        wait_for_event(Path(args.log_dir), "manager-up", args.wait_for, timeout=300.0)
    model = DistributedDataParallel(manager, base) if args.grad_sync == "ddp" else base
    optimizer = OptimizerWrapper(manager, inner)
    order = workload.sample_order(w)
    mine = [i for i in range(w.n_micro) if i % args.replicas == args.replica]
    log.event("ready", step=manager.current_step())

    position = 0
    while manager.current_step() < w.steps:
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)  # starts the quorum
        manager.wait_quorum()
        step = manager.current_step()
        key = position if args.data == "loader" else step
        # The quorum id is what changes when the participants do: the generation.
        gen = int(getattr(manager, "_quorum_id", -1))
        # A recovering replica computes but its gradient is zeroed: it does not take part.
        participating = manager.is_participating()
        loss_sum = 0.0
        for k, mb in enumerate(mine):
            x, y = workload.batch(data, order, key, mb)
            last = k == len(mine) - 1
            no_sync = isinstance(model, DistributedDataParallel) and not last
            with model.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
                with rng_scope(w.seed, key, mb):
                    loss = workload.loss_of(model, x, y)
                    loss_sum += loss.item()
                    if last:
                        log.work(gen, step, key, mine, loss_sum, t0, participating)
                    (loss / len(mine)).backward()  # type: ignore[no-untyped-call]
        if not isinstance(model, DistributedDataParallel):
            allreduce_grads(manager, base)
        world = manager.num_participants()
        optimizer.step()  # applies only if the Manager says the step may commit
        if manager.current_step() > step:
            log.commit(gen, step, [member] if participating else [], world, t0)
        position += 1
    if args.save:
        workload.save_params(base, args.save)
    log.event("done", step=manager.current_step())
    manager.shutdown(wait=False)
    log.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
