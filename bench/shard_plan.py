"""Cost of the sharded-state decisions, and bytes moved per single-node loss vs the ideal.

    scripts/env python bench/shard_plan.py [--members 1000 10000 100000] [--per-node 8]
        [--replicas 1] [--losses 20] [--repeats 5] [--bytes-members 16 32 64 256 1000]

Timing: for each member count, the best CPU time of ``--repeats`` runs computing the layout,
the replica placement and the transfer plan after losing one random node, as every
member does after the agents agree on the survivors (pure Python, one core). The plan is
kept as columns; materialising every ``Move`` row is timed on its own line. A yardstick
line (a bare 1M-iteration Python loop) lets figures be scaled between machines.

Bytes: for ``--losses`` random single-node losses at each of ``--bytes-members`` (equal
nodes of ``--per-node`` members), the elements the plan moves to new owners, to new
replicas and in all, over the ideal: the lost shards' elements. ``send``/``recv`` are the
most one member sends / receives, in (old) shards; ``pair`` the most moves between one
(sender, receiver) pair (1: every pair carries one contiguous range).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

from keepstep.elastic.shard import (
    Placement,
    Plan,
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


def _sizes(rng: random.Random, members: int) -> list[int]:
    # A few hundred tensors, ~2,000 elements per member: shapes matter, not magnitudes.
    return [rng.randrange(1, 4 * 2000 * members // 300 + 2) for _ in range(300)]


def _lose_node(rng: random.Random, members: list[str]) -> list[str]:
    node = rng.choice(sorted({node_of(m) for m in members}))
    return [m for m in members if node_of(m) != node]


def _replan(sizes: list[int], old: Placement, survivors: list[str], replicas: int) -> Plan:
    nodes = len({node_of(m) for m in survivors})
    new = place_replicas(make_layout(sizes, survivors), min(replicas, nodes - 1))
    return plan_transfers(old, new, survivors)


def _rows(plan: Plan) -> object:
    return dataclasses.replace(plan).moves  # a fresh copy: its rows are not cached yet


def timing(args: argparse.Namespace) -> None:
    loop = _best_ms(lambda: sum(1 for _ in range(1_000_000)), args.repeats)
    print(f"yardstick: a 1M-iteration Python loop takes {loop:.1f} ms here")
    print(f"{'members':>8} {'layout':>9} {'replicas':>9} {'plan':>9} {'total':>9}   moves")
    for count in args.members:
        rng = random.Random(args.seed)
        members = _cluster(count, args.per_node)
        sizes = _sizes(rng, count)
        old = place_replicas(make_layout(sizes, members), args.replicas)
        survivors = _lose_node(rng, members)
        nodes = len({node_of(m) for m in survivors})
        r = min(args.replicas, nodes - 1)
        layout_ms = _best_ms(partial(make_layout, sizes, survivors), args.repeats)
        new_layout = make_layout(sizes, survivors)
        place_ms = _best_ms(partial(place_replicas, new_layout, r), args.repeats)
        new = place_replicas(new_layout, r)
        plan_ms = _best_ms(partial(plan_transfers, old, new, survivors), args.repeats)
        plan = plan_transfers(old, new, survivors)
        rows_ms = _best_ms(partial(_rows, plan), args.repeats)
        total = layout_ms + place_ms + plan_ms
        print(
            f"{count:>8} {layout_ms:>7.1f}ms {place_ms:>7.1f}ms {plan_ms:>7.1f}ms "
            f"{total:>7.1f}ms   {len(plan)} (as Move rows: +{rows_ms:.1f} ms)"
        )


def moved(args: argparse.Namespace) -> None:
    print(
        f"\nbytes moved per single-node loss / lost shard bytes, {args.losses} random losses "
        f"each (min / median / max), {args.per_node} members per node, "
        f"replicas={args.replicas}"
    )
    print(
        f"{'members':>8} {'nodes':>6} {'to owners':>17} {'to replicas':>17} {'all':>17} "
        f"{'send':>5} {'recv':>5} {'pair':>5}"
    )
    for count in args.bytes_members:
        rng = random.Random(args.seed)
        members = _cluster(count, args.per_node)
        sizes = _sizes(rng, count)
        old = place_replicas(make_layout(sizes, members), args.replicas)
        shard = max(old.layout.shard_sizes())
        owners, replicas, both, send, recv, pairs = [], [], [], 0.0, 0.0, 0
        for _ in range(args.losses):
            plan = _replan(sizes, old, _lose_node(rng, members), args.replicas)
            lost = plan.lost_elements
            owners.append(plan.elements(owners=True) / lost)
            replicas.append(plan.elements(owners=False) / lost)
            both.append(plan.elements() / lost)
            send = max(send, max(plan.sent().values(), default=0) / shard)
            recv = max(recv, max(plan.received().values(), default=0) / shard)
            per_pair = Counter(zip(plan.src, plan.dst, strict=True))
            pairs = max(pairs, max(per_pair.values(), default=0))

        def span(xs: list[float]) -> str:
            return f"{min(xs):.2f}/{statistics.median(xs):.2f}/{max(xs):.2f}"

        nodes = len({node_of(m) for m in members})
        print(
            f"{count:>8} {nodes:>6} {span(owners):>17} {span(replicas):>17} {span(both):>17} "
            f"{send:>5.2f} {recv:>5.2f} {pairs:>5}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--bytes-members", type=int, nargs="+", default=[16, 32, 64, 256, 1000])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--losses", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    timing(args)
    moved(args)


if __name__ == "__main__":
    main()
