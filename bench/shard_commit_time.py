"""Time of a sharded commit's replica exchange, on its own: what ZeRO adds to every step.

    scripts/env python bench/shard_commit_time.py [--ranks 2,4] [--commits 6] [--size large-short]

Each member of a W-member epoch holds its owned pieces of a trained AdamW state of the
example transformer (examples/transformer.py); every commit it calls
``sharded_snapshot.exchange_pieces``, as ``ShardedOptimizer.step`` does after every ZeRO-2
step and at an epoch's first ZeRO-1 commit (later ZeRO-1 commits step the replicas where
they are kept, zero/replicas.py): one ``alltoall`` over gloo that sends each peer the part
of its state the peer keeps as a replica, and the snapshot's segments (views of its own
pieces and of those received). The
members are threads of this process over a real gloo group (one ``Communicator`` each),
so the figure includes the GIL's contention among them; the processes of a job do not
share one. The first commit fills the epoch's buffers (``Buffers``), the later ones reuse
them: the table gives the first commit and the median of the rest, per member count, with
the bytes each member sent and the size of its snapshot's pieces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import HashStore

from keepstep.elastic.comm.communicator import Communicator
from keepstep.elastic.shard_epoch import epoch_shards
from keepstep.elastic.sharded_snapshot import Buffers, exchange_pieces
from keepstep.elastic.snapshot_pieces import pack_segments
from keepstep.elastic.snapshot_shard import cut_state
from keepstep.elastic.zero import ELEMENTWISE

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from transformer import TinyGPT  # noqa: E402

SIZES = {  # name: (d_model, layers, seq), as bench/shard_step_time.py names them
    "small": (64, 2, 32),
    "medium": (128, 2, 64),
    "large-short": (384, 6, 256),
}
KEYS = ELEMENTWISE[torch.optim.AdamW]
TIMEOUT = timedelta(seconds=120)


def trained_state(size: str) -> tuple[dict[str, Any], list[int]]:
    """A full AdamW state one step in, and its parameters' sizes."""
    d, layers, seq = SIZES[size]
    torch.manual_seed(0)
    params = list(TinyGPT(128, seq, d, layers, max(1, d // 64)).parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict(), [p.numel() for p in params]


def communicators(members: list[str]) -> list[Communicator]:
    store, made = HashStore(), {}

    def build(me: str) -> None:
        made[me] = Communicator.create(store, 0, members, me, timeout=TIMEOUT)

    threads = [threading.Thread(target=build, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if sorted(made) != sorted(members):
        raise SystemExit(f"only {sorted(made)} of {members} built their communicator")
    return [made[m] for m in members]


def measure(size: str, world: int, commits: int) -> dict[str, Any]:
    full, sizes = trained_state(size)
    members = [f"n{i}/0" for i in range(world)]  # one member a node: replicas go across
    shards = epoch_shards(sizes, members)
    owners = [shards.owned[m] for m in members]
    holds = [shards.held[m] for m in members]
    comms = communicators(members)
    seconds: list[list[float]] = [[] for _ in members]
    snapshot_bytes = [0] * world
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        state = cut_state(full, sizes, KEYS, owners[rank])
        buffers = Buffers()
        try:
            for _ in range(commits):
                began = time.perf_counter()
                own, received = exchange_pieces(
                    comms[rank], state, owners, holds, sizes, KEYS, TIMEOUT, buffers
                )
                out = pack_segments(own, received)
                seconds[rank].append(time.perf_counter() - began)
                snapshot_bytes[rank] = sum(t.numel() * t.element_size() for t in out)
        except BaseException as err:  # reported below, with the others' figures
            errors.append(err)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for comm in comms:
        comm.close()
    if errors:
        raise SystemExit(f"W={world}: a commit failed: {errors[0]!r}")
    state_bytes = sum(
        v.numel() * v.element_size()
        for per_param in full["state"].values()
        for k, v in per_param.items()
        if k in KEYS
    )
    return {
        "world": world,
        "first_s": max(s[0] for s in seconds),
        "median_s": statistics.median(max(s[i] for s in seconds) for i in range(1, commits)),
        "state_mb": state_bytes / 1e6,
        "snapshot_mb": max(snapshot_bytes) / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="member counts, comma-separated")
    parser.add_argument("--commits", type=int, default=6, help="per member count, >= 2")
    parser.add_argument("--size", default="large-short", choices=sorted(SIZES))
    args = parser.parse_args()
    try:
        worlds = [int(w) for w in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks {args.ranks!r}: comma-separated whole numbers, e.g. 2,4")
    if any(w < 2 for w in worlds) or args.commits < 2:
        parser.error(f"--ranks {args.ranks!r} and --commits {args.commits}: each at least 2")
    torch.set_num_threads(1)
    print(f"{args.size}: AdamW state of examples/transformer.py; members on threads, gloo")
    print(f"{'W':>3} {'state MB':>9} {'snapshot MB':>12} {'first s':>8} {'median s':>9}")
    for world in worlds:
        row = measure(args.size, world, args.commits)
        print(
            f"{row['world']:>3} {row['state_mb']:>9.1f} {row['snapshot_mb']:>12.1f} "
            f"{row['first_s']:>8.3f} {row['median_s']:>9.3f}"
        )


if __name__ == "__main__":
    main()
