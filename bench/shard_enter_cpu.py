"""CPU one member spends entering a ZeRO-1 epoch after a node is lost, measured alone.

    scripts/env python bench/shard_enter_cpu.py [--nodes 8] [--per-node 1] [--rounds 5]
        [--d-model 64] [--layers 2] [--vocab 128] [--chunks N] [--profile]

Why alone: in a job every member enters at once, so on a machine with fewer cores than
members their enters share the cores, and the wall time of the reshard phase
(`reshard_s` in a recovery record) is the members' CPU added up. This measures one
member's share: the job's members run on threads of this process, joined by a hub for
their collectives: all enter a first epoch from the full state of a trained AdamW, then
the survivors of node n1 enter the next (`ShardedOptimizer.enter`), each holding the
pieces its snapshot of the first epoch keeps. The first member's collective answers are
recorded; its enter is then run again alone, the answers replayed, and timed with
`time.process_time`. Parameters are a GPT-like model's tensors
(embedding, per layer attention and MLP; the defaults are about examples/transformer.py's
small model). The chunks are the job's (shard_epoch.agreed_chunks: fewer for a small
model), or --chunks if more (1024 shows a large model's count on this one). Prints JSON:
the shape, the chunk count, bytes received, and the CPU ms of each round with their
median; with --profile, cProfile's top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch

from keepstep.elastic.shard_epoch import agreed_chunks, epoch_shards
from keepstep.elastic.sharded import ShardedOptimizer
from keepstep.elastic.sharded_comm import PieceCollective
from keepstep.elastic.sharded_snapshot import pieces_tensor, snapshot_entries
from keepstep.elastic.zero import ELEMENTWISE

TIMEOUT = timedelta(seconds=60)


def gpt_sizes(d: int, layers: int, vocab: int) -> list[int]:
    """A GPT-style model's parameter sizes (embedding, per layer attention and MLP, head)."""
    sizes = [vocab * d]
    for _ in range(layers):
        sizes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [*sizes, d, d, vocab * d]


def trained(sizes: Sequence[int]) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Parameters of ``sizes`` and an AdamW that has taken one step (its state is full)."""
    gen = torch.Generator().manual_seed(0)
    params: list[torch.Tensor] = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return params, opt


class Hub:
    """The collectives ``enter`` uses, among members on threads of this process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[Any] = [None] * world

    def round(self, rank: int, mine: Any) -> list[Any]:
        self.slots[rank] = mine
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class Member:
    """One member's end of the hub; records its answers when ``log`` is a list."""

    device = torch.device("cpu")  # where the shard's gathers would receive

    def __init__(self, hub: Hub, rank: int, log: list[list[bytes]] | None) -> None:
        self.hub, self.rank, self.size, self.log = hub, rank, hub.world, log

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        return self._kept(self.hub.round(self.rank, payload))

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        rows = self.hub.round(self.rank, list(payloads))
        return self._kept([rows[src][self.rank] for src in range(self.size)])

    def _kept(self, answer: list[bytes]) -> list[bytes]:
        if self.log is not None:
            self.log.append(answer)
        return answer


class Replay:
    """Member 0's collectives answered from what it received when all members entered."""

    rank = 0
    device = torch.device("cpu")

    def __init__(self, size: int, answers: list[list[bytes]]) -> None:
        self.size, self._answers = size, iter(answers)

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        return next(self._answers)

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        return next(self._answers)


def collective(comm: Member | Replay) -> PieceCollective:
    """The hub's ends have only what ``enter`` calls (no tensor collective, no alltoall
    of tensors): enough for this bench, typed as the epoch's communicator."""
    return cast(PieceCollective, comm)


def all_enter(
    optimizers: Sequence[ShardedOptimizer], members: Sequence[str], views: Sequence[int | None]
) -> list[list[bytes]]:
    """Every member enters the epoch of ``members`` at once, each on a thread; returns the
    answers rank 0's collectives got."""
    hub, answers = Hub(len(members)), list[list[bytes]]()

    def enter(rank: int) -> None:
        comm = Member(hub, rank, answers if rank == 0 else None)
        optimizers[rank].enter(collective(comm), members, TIMEOUT, views)

    threads = [threading.Thread(target=enter, args=(r,)) for r in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--per-node", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument(
        "--chunks", type=int, default=0, help="cut at least this many (e.g. 1024: a large model's)"
    )
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = parser.parse_args()
    if args.nodes < 3 or args.per_node < 1 or args.rounds < 1 or args.chunks < 0:
        parser.error(
            f"--nodes {args.nodes} must be >= 3 (two survive, with replicas), "
            f"--per-node {args.per_node} and --rounds {args.rounds} >= 1, "
            f"--chunks {args.chunks} >= 0"
        )
    torch.set_num_threads(1)
    sizes = gpt_sizes(args.d_model, args.layers, args.vocab)
    members = [f"n{n}/{i}" for n in range(args.nodes) for i in range(args.per_node)]
    survivors = [m for m in members if not m.startswith("n1/")]
    # The first epoch, entered from the full state (step 0) by every member.
    firsts = [ShardedOptimizer(*trained(sizes)) for _ in members]
    chunks = max(agreed_chunks(members, (), sum(sizes)), args.chunks)
    first = all_enter(firsts, members, [chunks] * len(members))
    held = epoch_shards(sizes, members, chunks=chunks).held
    full, keys = trained(sizes)[1].state_dict(), ELEMENTWISE[torch.optim.AdamW]
    pieces = {m: snapshot_entries([pieces_tensor(full, sizes, keys, held[m])]) for m in members}
    views: list[int | None] = [chunks] * len(survivors)

    def restored(member: str, first_answers: list[list[bytes]]) -> ShardedOptimizer:
        """``member`` after the first epoch, its snapshot of pieces just restored."""
        sharded = ShardedOptimizer(*trained(sizes))
        replay = collective(Replay(len(members), first_answers))
        sharded.enter(replay, members, TIMEOUT, [chunks] * len(members))
        sharded.from_snapshot(dict(pieces[member]))
        return sharded

    # Node n1 lost: the survivors enter together once, to record rank 0's answers.
    alive = [first_opt for m, first_opt in zip(members, firsts, strict=True) if m in survivors]
    for member, sharded in zip(survivors, alive, strict=True):
        sharded.from_snapshot(dict(pieces[member]))
    second = all_enter(alive, survivors, views)
    cpu_ms, received = [], 0
    for _ in range(args.rounds):
        alone = restored(survivors[0], first)
        started = time.process_time()
        alone.enter(collective(Replay(len(survivors), second)), survivors, TIMEOUT, views)
        cpu_ms.append(round((time.process_time() - started) * 1000, 1))
        received = alone.received_bytes
    if received != alive[0].received_bytes:  # the replay must be the enter it stands for
        raise SystemExit(f"replayed enter received {received} B, not {alive[0].received_bytes}")
    figures = {
        "nodes": args.nodes,
        "per_node": args.per_node,
        "survivors": len(survivors),
        "elements": sum(sizes),
        "chunks": chunks,
        "received_bytes": received,
        "enter_cpu_ms": cpu_ms,
        "enter_cpu_ms_median": statistics.median(cpu_ms),
    }
    print(json.dumps(figures))
    if args.profile:
        alone = restored(survivors[0], first)
        profile = cProfile.Profile()
        replay = collective(Replay(len(survivors), second))
        profile.runcall(alone.enter, replay, survivors, TIMEOUT, views)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
