"""Cost of the sharded-state decisions, and bytes moved per single-node loss vs the ideal,
for both layouts: contiguous slices (``make_layout``) and chunks (``make_chunk_layout``).

    scripts/env python bench/shard_plan.py [--members 1000 10000 100000] [--per-node 8]
        [--replicas 1] [--losses 20] [--repeats 5] [--bytes-members 16 32 64 256 1000]
        [--elements 1048576] [--layouts contiguous chunked]

Timing: for each member count, the best CPU time of ``--repeats`` runs computing what every
member computes after the agents agree on the survivors of one lost node (pure Python,
one core). Contiguous: the layout of the survivors, its replicas, the transfer plan.
Chunked: the survivors' layout derived from the old one (``without``, given who left, or
``relayout``, given the survivors), its replicas, the plan; and, once, the layout built
from nothing (``build``: at job start and for a join). A yardstick line (a bare
1M-iteration Python loop) lets figures be scaled between machines.

Sizes: 300 tensors, ``--elements`` per member in all (default 2**20).

Bytes: for ``--losses`` random single-node losses at each of ``--bytes-members`` (equal
nodes of ``--per-node`` members), over the lost shards' elements (``lost``: what the lost
node owned): ``owners``, what new owners fetch (the chunked ideal is 0: a lost chunk's
replica keeper is its next owner); ``replicas``, what new replica keepers fetch; ``all``,
both; ``floor``, the copies the lost node held, which every layout must make again (a new
replica of each chunk it owned and the replicas it kept: about 2.0 with one replica).
Bytes moved beyond the floor are ``all - floor``. ``send``/``recv``:
the most one member sends / receives, in shards; ``pair``: the most moves between one
(sender, receiver) pair; ``bal``: the largest shard over the mean. Join: a node of
``--per-node`` members joins; what the joiners receive as owners over their share of the
state (ideal 1.0), then everything moved (replicas too) over that share.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from keepstep.elastic.shard import (
    ChunkPlacement,
    Placement,
    Plan,
    make_chunk_layout,
    make_layout,
    node_of,
    place_replicas,
    plan_transfers,
)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    # CPU time of this process, best of N (as timeit advises): the work is one thread of
    # pure Python, and on a shared machine wall time would measure the neighbours too.
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def _cluster(members: int, per_node: int) -> list[str]:
    return [f"n{i // per_node}/{i % per_node}" for i in range(members)]


def _sizes(rng: random.Random, members: int, per_member: int) -> list[int]:
    # A few hundred tensors of ~per_member elements per member in all. The contiguous
    # layout's cost depends on shapes only; the chunked one needs units (128 elements)
    # for its chunks: a million elements per member is a 100M-parameter model on 100.
    return [rng.randrange(1, 2 * per_member * members // 300 + 2) for _ in range(300)]


def _lose_node(rng: random.Random, members: list[str]) -> tuple[str, list[str]]:
    node = rng.choice(sorted({node_of(m) for m in members}))
    return node, [m for m in members if node_of(m) != node]


def _replicas(members: list[str], replicas: int) -> int:
    return min(replicas, len({node_of(m) for m in members}) - 1)


def _time_contiguous(
    sizes: list[int], members: list[str], survivors: list[str], replicas: int, repeats: int
) -> str:
    old = place_replicas(make_layout(sizes, members), replicas)
    r = _replicas(survivors, replicas)
    lay_ms = _best_ms(lambda: make_layout(sizes, survivors), repeats)
    new_layout = make_layout(sizes, survivors)
    rep_ms = _best_ms(lambda: place_replicas(new_layout, r), repeats)
    new = place_replicas(new_layout, r)
    plan_ms = _best_ms(lambda: plan_transfers(old, new, survivors), repeats)
    moves = len(plan_transfers(old, new, survivors))
    total = lay_ms + rep_ms + plan_ms
    return f"{lay_ms:>7.1f}ms {rep_ms:>7.1f}ms {plan_ms:>7.1f}ms {total:>7.1f}ms  {moves} moves"


def _time_chunked(
    sizes: list[int], members: list[str], survivors: list[str], replicas: int, repeats: int
) -> str:
    start = time.process_time()
    layout = make_chunk_layout(sizes, members, align=128)
    build = time.process_time() - start
    _ = layout.node_members, layout.member_set  # the old layout's, at hand before a loss
    old = place_replicas(layout, replicas)
    r = _replicas(survivors, replicas)
    lost = sorted(layout.member_set.difference(survivors))
    lay_ms = _best_ms(lambda: layout.without(lost), repeats)
    derived = layout.without(lost)
    rep_ms = _best_ms(lambda: place_replicas(derived, r), repeats)
    new = place_replicas(derived, r)
    live = derived.member_set
    plan_ms = _best_ms(lambda: plan_transfers(old, new, live), repeats)
    moves = len(plan_transfers(old, new, live))
    listed = _best_ms(
        lambda: plan_transfers(old, place_replicas(layout.relayout(survivors), r), survivors),
        repeats,
    )
    total = lay_ms + rep_ms + plan_ms
    return (
        f"{lay_ms:>7.1f}ms {rep_ms:>7.1f}ms {plan_ms:>7.1f}ms {total:>7.1f}ms  {moves} moves; "
        f"from the survivors' list {listed:.1f} ms; built in {build:.1f} s "
        f"({layout.chunks} chunks)"
    )


def timing(args: argparse.Namespace) -> None:
    loop = _best_ms(lambda: sum(1 for _ in range(1_000_000)), args.repeats)
    print(f"yardstick: a 1M-iteration Python loop takes {loop:.1f} ms here")
    print(f"{'':>10} {'members':>8} {'layout':>9} {'replicas':>9} {'plan':>9} {'total':>9}  notes")
    for count in args.members:
        rng = random.Random(args.seed)
        members = _cluster(count, args.per_node)
        sizes = _sizes(rng, count, args.elements)
        _, survivors = _lose_node(rng, members)
        for kind, timer in (("contiguous", _time_contiguous), ("chunked", _time_chunked)):
            if kind in args.layouts:
                row = timer(sizes, members, survivors, args.replicas, args.repeats)
                print(f"{kind:>10} {count:>8} {row}", flush=True)


def _ratios(plan: Plan[Any], lost_node: str, shard: int) -> dict[str, float]:
    lost = plan.lost_elements
    held = sum(b - a for m, a, b, _ in plan.old.holdings() if node_of(m) == lost_node)
    recreate = held if plan.new.replicas else 0  # a new copy of all it owned and kept
    owners = plan.elements(owners=True)
    everything = plan.elements()
    per_pair = Counter(zip(plan.src, plan.dst, strict=True))
    return {
        "owners": owners / lost,
        "replicas": (everything - owners) / lost,
        "all": everything / lost,
        "floor": recreate / lost,
        "send": max(plan.sent().values(), default=0) / shard,
        "recv": max(plan.received().values(), default=0) / shard,
        "pair": max(per_pair.values(), default=0),
    }


def _placed(kind: str, sizes: list[int], members: list[str], replicas: int) -> Any:
    if kind == "contiguous":
        return place_replicas(make_layout(sizes, members), replicas)
    return place_replicas(make_chunk_layout(sizes, members, align=128), replicas)


def _after(kind: str, old: Any, members: list[str], replicas: int) -> Any:
    r = _replicas(members, replicas)
    if kind == "contiguous":
        return place_replicas(make_layout(list(old.layout.sizes), members), r)
    return place_replicas(old.layout.relayout(members), r)


def moved(args: argparse.Namespace) -> None:
    print(
        f"\nper single-node loss, over the lost shards' elements; {args.losses} random losses "
        f"(median/max), {args.per_node} members per node, replicas={args.replicas}"
    )
    print(
        f"{'':>10} {'members':>7} {'owners':>11} {'replicas':>11} {'all':>11} {'floor':>11} "
        f"{'send':>5} {'recv':>5} {'pair':>5} {'bal':>5} {'join':>11}"
    )
    for kind in args.layouts:
        for count in args.bytes_members:
            rng = random.Random(args.seed)
            members = _cluster(count, args.per_node)
            sizes = _sizes(rng, count, args.elements)
            old: Placement | ChunkPlacement = _placed(kind, sizes, members, args.replicas)
            shard_sizes = old.layout.shard_sizes()
            shard = max(shard_sizes)
            rows: dict[str, list[float]] = {}
            for _ in range(args.losses):
                node, survivors = _lose_node(rng, members)
                plan = plan_transfers(old, _after(kind, old, survivors, args.replicas), survivors)
                for key, value in _ratios(plan, node, shard).items():
                    rows.setdefault(key, []).append(value)
            joiners = [f"new/{i}" for i in range(args.per_node)]
            grown = _after(kind, old, [*members, *joiners], args.replicas)
            join = plan_transfers(old, grown, members)
            share = sum(sizes) * len(joiners) / (count + len(joiners))
            got = sum(
                b - a
                for d, a, b, k in zip(join.dst, join.start, join.stop, join.copy, strict=True)
                if k == 0 and d in joiners
            )

            def span(key: str, rows: dict[str, list[float]] = rows) -> str:
                return f"{statistics.median(rows[key]):.2f}/{max(rows[key]):.2f}"

            print(
                f"{kind:>10} {count:>7} {span('owners'):>11} {span('replicas'):>11} "
                f"{span('all'):>11} {span('floor'):>11} {max(rows['send']):>5.2f} "
                f"{max(rows['recv']):>5.2f} {max(rows['pair']):>5.0f} "
                f"{shard * count / sum(sizes):>5.2f} "
                f"{got / share:>5.2f}/{join.elements() / share:<5.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="*", default=[1000, 10_000, 100_000])
    parser.add_argument("--bytes-members", type=int, nargs="*", default=[16, 32, 64, 256, 1000])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--losses", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--elements", type=int, default=1 << 20, help="per member")
    parser.add_argument(
        "--layouts", nargs="+", default=["contiguous", "chunked"], choices=["contiguous", "chunked"]
    )
    args = parser.parse_args()
    timing(args)
    moved(args)


if __name__ == "__main__":
    main()
