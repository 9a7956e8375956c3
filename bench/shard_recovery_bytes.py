"""Elements a sharded job moves to recover from one lost node, against the lost shard.

    scripts/env python bench/shard_recovery_bytes.py [--sizes transformer|random] [--uneven N]
        [--seed S]

For each job shape (nodes x workers per node) and each node lost in turn: the epoch's
shards before (``keepstep.elastic.shard_epoch.epoch_shards``, cut into the chunk count a
first epoch of that shape agrees, ``agreed_chunks``: what the job uses), the survivors'
holdings (own chunks and replicas), the shards after (derived from those before, as the
job does), and the disjoint fetch plan between them (``shard.fetch.plan_fetches``, what
the job runs). Prints, per shape, the chunk count,
the elements moved over the lost elements (ideal: at most 1; the issue's target 1.1)
worst and mean over the lost nodes, the most any one member sends over an even share
of the lost elements, and the time to compute shards and plan. Pure: no processes.
With ``--uneven N``: N seeded clusters whose nodes hold 1-14 members each instead, and the
worst figures over them on a last line.

ZeRO-1 also fetches, entering, the replicas each survivor keeps in the new epoch (it
steps them from the first commit on instead of receiving them at every commit): the
"with_replicas" figures are the elements that plan moves over what the lost node held
(its own chunks and the replicas it kept, each of which needs a new keeper: ideal 1).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from keepstep.elastic.shard.fetch import Announcement, plan_fetches
from keepstep.elastic.shard_epoch import agreed_chunks, epoch_shards
from keepstep.elastic.snapshot_shard import merge

SHAPES = [(2, 1), (4, 1), (4, 2), (8, 1), (8, 2), (16, 1), (32, 1), (64, 1)]
UNEVEN_NODE_SIZES = (1, 1, 2, 2, 3, 4, 4, 6, 8, 10, 14)  # members per node, drawn


def transformer_sizes(d: int = 1024, layers: int = 12, vocab: int = 32000) -> list[int]:
    """A GPT-style model's parameter sizes (embedding, per layer attention and MLP)."""
    sizes = [vocab * d]
    for _ in range(layers):
        sizes += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [*sizes, d, d]


def uneven_clusters(count: int, seed: int) -> list[list[int]]:
    """``count`` clusters of 2-16 nodes of 1-14 members each (at most 64 in all), seeded:
    the shapes where the replica bound binds on most nodes."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        counts = [rng.choice(UNEVEN_NODE_SIZES) for _ in range(rng.randint(2, 16))]
        while sum(counts) > 64:
            counts[counts.index(max(counts))] -= 1
        out.append(counts)
    return out


def one_shape(sizes: list[int], counts: list[int]) -> dict[str, float]:
    nodes = len(counts)
    members = [f"n{n}/{i}" for n, k in enumerate(counts) for i in range(k)]
    start = time.perf_counter()
    chunks = agreed_chunks(members, (), sum(sizes))  # a first epoch's count, kept after a loss
    before = epoch_shards(sizes, members, chunks=chunks)
    ratios, sender_ratios, plan_s, replica_ratios = [], [], [], []
    for lost_node in range(nodes):
        survivors = [m for m in members if not m.startswith(f"n{lost_node}/")]
        t0 = time.perf_counter()
        after = epoch_shards(
            sizes, survivors, before, agreed_chunks(survivors, [chunks], sum(sizes))
        )
        plan = plan_fetches([Announcement(before.held[m], after.owned[m]) for m in survivors])
        plan_s.append(time.perf_counter() - t0)
        assert plan.lost == (), plan.lost[:3]
        lost = sum(r.size for m in members if m not in survivors for r in before.owned[m])
        sent = [plan.sent(s) for s in range(len(survivors))]
        ratios.append(sum(sent) / lost)
        sender_ratios.append(max(sent) / (lost / len(survivors)))
        kept = [merge([*after.owned[m], *after.held[m]]) for m in survivors]
        full = plan_fetches(
            [Announcement(before.held[m], k) for m, k in zip(survivors, kept, strict=True)]
        )
        held = sum(r.size for m in members if m not in survivors for r in before.held[m])
        replica_ratios.append(sum(full.sent(s) for s in range(len(survivors))) / held)
    return {
        "members": len(members),
        "chunks": chunks,
        "moved_over_lost_max": round(max(ratios), 4),
        "moved_over_lost_mean": round(sum(ratios) / len(ratios), 4),
        "max_sender_over_even_share": round(max(sender_ratios), 3),
        "with_replicas_over_lost_held_max": round(max(replica_ratios), 4),
        "with_replicas_over_lost_held_mean": round(sum(replica_ratios) / len(replica_ratios), 4),
        "first_shards_s": round(plan_s[0] if plan_s else 0.0, 4),
        "shards_and_plan_s_mean": round(sum(plan_s) / len(plan_s), 4),
        "total_s": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", choices=("transformer", "random"), default="transformer")
    parser.add_argument(
        "--uneven",
        type=int,
        default=0,
        metavar="N",
        help="instead of the equal shapes: N seeded clusters of nodes of uneven sizes",
    )
    parser.add_argument("--seed", type=int, default=1, help="the --uneven clusters' seed")
    args = parser.parse_args()
    if args.uneven < 0:
        parser.error(f"--uneven {args.uneven}: must be 0 (equal shapes) or more clusters")
    if args.sizes == "transformer":
        sizes = transformer_sizes()
    else:
        rng = random.Random(1)
        sizes = [rng.randrange(1, 400_000) for _ in range(40)]
    print(f"# {len(sizes)} tensors, {sum(sizes):,} elements")
    if not args.uneven:
        for nodes, per_node in SHAPES:
            figures = one_shape(sizes, [per_node] * nodes)
            print(json.dumps({"nodes": nodes, "per_node": per_node, **figures}))
        return
    worst: dict[str, float] = {}
    for counts in uneven_clusters(args.uneven, args.seed):
        figures = one_shape(sizes, counts)
        print(json.dumps({"node_sizes": counts, **figures}))
        for key in ("moved_over_lost_max", "with_replicas_over_lost_held_max"):
            worst[key] = max(worst.get(key, 0.0), figures[key])
    print(json.dumps({"clusters": args.uneven, "seed": args.seed, "worst": worst}))


if __name__ == "__main__":
    main()
