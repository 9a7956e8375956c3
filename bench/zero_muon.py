"""Muon under ZeRO: what each member computes, keeps and sends per step, at W members.

    scripts/env python bench/zero_muon.py [--members 1 2 4 8] [--d-model 1024]
        [--layers 8] [--repeats 3]

The matrices are a decoder's hidden ones (per layer: qkv 3d x d, out d x d, MLP up 4d x d
and down d x 4d), stepped by Muon; the job's own ownership (shard_epoch.ownership_for,
members one per node) cuts them. Per member count it prints:

    touched      matrices a member's shard touches (its windows): what each member would
                 orthogonalise if every member touching a matrix stepped it whole
    designated   matrices the member steps whole (zero/muon.py ``designate``)
    ns_s         seconds of Newton-Schulz for the member's designated matrices, the
                 largest over members, measured here (each shape timed alone, median of
                 ``--repeats``); W=1 is what every member of an unsharded job spends
    momentum_mb  MB of momentum the member keeps (fp32, its owned elements)
    sent_mb      MB of updates the member sends per step (its owned pieces of matrices
                 other members step), the largest over members
    recv_mb      MB of updates it receives (the pieces of its matrices others own); an
                 all-gather would bring every member all but its own pieces instead
    slow_s       with the last member ``--slow`` times slower (its seconds scaled by it),
                 the step's Newton-Schulz critical path (the largest member's seconds):
                 matrices designated by cost alone / by the plan's weights (speeds 1 and
                 1/slow, as balance="speed" would weigh them)

Figures are counts and bytes, except ns_s, which is CPU time on this machine (the one
machine's figure: compare them with each other, not with a GPU's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.optim import _muon

from keepstep.elastic.shard_epoch import ownership_for
from keepstep.elastic.zero.muon import designate, ns_cost


def _shapes(d: int, layers: int) -> list[tuple[int, int]]:
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def _ns_seconds(shape: tuple[int, int], repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    update = torch.randn(shape, generator=g)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _muon._zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _slowed(
    shapes: list[tuple[int, int]], seconds: dict[tuple[int, int], float], world: int, slow: float
) -> dict[str, float]:
    """The Newton-Schulz critical path with the last member ``slow`` times slower: the
    matrices designated by cost alone, and by speed."""
    factor = [1.0] * (world - 1) + [slow]
    out = {}
    for name, speeds in (("cost", None), ("speed", [1 / f for f in factor])):
        given = designate(dict(enumerate(shapes)), world, speeds)
        per = [0.0] * world
        for t, r in given.items():
            per[r] += seconds[shapes[t]] * factor[r]
        out[f"slow_by_{name}_s"] = max(per)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow", type=float, default=4.0, help="the slow member's factor")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a member's step runs on one intra-op thread
    shapes = _shapes(args.d_model, args.layers)
    sizes = [m * n for m, n in shapes]
    seconds = {s: _ns_seconds(s, args.repeats) for s in sorted(set(shapes))}
    total = sum(sizes)
    print(
        f"{len(shapes)} matrices, {total / 1e6:.1f} M elements; Newton-Schulz on one "
        f"thread here: {sum(seconds[s] for s in shapes):.2f} s per step for all of them"
    )
    print(f"{'W':>3} {'touched':>14} {'designated':>14} {'ns_s':>7} {'momentum_mb':>12} "
          f"{'sent_mb':>8} {'recv_mb':>8} {'allgather_mb':>13} {'slow_s':>13}")  # fmt: skip
    rows = []
    for world in args.members:
        members = [f"n{i}/0" for i in range(world)]
        own = ownership_for(sizes, members)
        touched = [len({pc.tensor for pc in own.pieces(r)}) for r in range(world)]
        given = designate(dict(enumerate(shapes)), world)
        mine = [[t for t, r in given.items() if r == rank] for rank in range(world)]
        ns = [sum(seconds[shapes[t]] for t in m) for m in mine]
        owned = [own.owned(r) for r in range(world)]
        sent = [
            sum(b - a for t, a, b in own.pieces(r) if given[t] != r) * 4 / 1e6 for r in range(world)
        ]
        recv = [
            sum(b - a for q in range(world) if q != r for t, a, b in own.pieces(q) if given[t] == r)
            * 4
            / 1e6
            for r in range(world)
        ]
        row = {
            "members": world,
            "touched_max": max(touched),
            "touched_mean": statistics.mean(touched),
            "designated_max": max(len(m) for m in mine),
            "ns_cost_share_max": max(sum(ns_cost(shapes[t]) for t in m) for m in mine)
            / sum(ns_cost(s) for s in shapes),
            "ns_s_max": max(ns),
            "momentum_mb_max": max(owned) * 4 / 1e6,
            "sent_mb_max": max(sent),
            "recv_mb_max": max(recv),
            # what each member would receive from an all-gather of the updates instead
            "allgather_recv_mb_max": max(total - o for o in owned) * 4 / 1e6,
            **_slowed(shapes, seconds, world, args.slow),
        }
        rows.append(row)
        spread = f"{statistics.mean(touched):.1f} (max {max(touched)})"
        print(
            f"{world:>3} {spread:>14} "
            f"{row['designated_max']:>14} {row['ns_s_max']:>7.2f} "
            f"{row['momentum_mb_max']:>12.1f} {row['sent_mb_max']:>8.1f} "
            f"{row['recv_mb_max']:>8.1f} {row['allgather_recv_mb_max']:>13.1f} "
            f"{row['slow_by_cost_s']:>6.2f}/{row['slow_by_speed_s']:<6.2f}"
        )
    print("RESULT " + json.dumps({"d_model": args.d_model, "layers": args.layers, "rows": rows}))


if __name__ == "__main__":
    main()
