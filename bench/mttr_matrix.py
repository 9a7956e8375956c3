"""Time to recover across optimizer sharding and job size: bench/mttr.py as one table.

    scripts/env python bench/mttr_matrix.py [--nodes-list 2,4,8] [--shards none,zero1,zero2]
        [--faults-per-kind 3] [--size small|medium] [--join-after STEPS] [--json PATH]

For each shard setting (none: full replicas; zero1, zero2: `keepstep run --shard`) and each
node count it calls bench/mttr.py's `measure` for kill-node and kill-worker on
examples/transformer.py (AdamW, dropout; --size picks the model: small is d_model 64,
2 layers, seq 32; medium d_model 128, 2 layers, seq 64). So every cell is bench/mttr.py's
job and fault schedule with another script: each node loss followed by a join (at once,
or --join-after steps later: a joiner's start-up, ~3.5 CPU-s of python and torch, otherwise
shares a small machine's cores with the recovery measured; on 2 nodes always at once, and
worker kills at least 60 steps apart, so that no fault hits a lone survivor), worker
kills going round the nodes, and a fault-free run of the same length to check the final
parameters against. The transformer takes no --sleep: its steps take what they take, so on
fast steps raise --node-spacing until a joiner is admitted before the next node loss (on
2 nodes the node hit next is the one that joined one spacing before).

One row per (shard, nodes). Per kind, n is the faults measured of those wanted; MTTR p50
and p95 in ms run from the fault injected to the first step committed after it; "moved"
is the p50 over those recoveries of the optimizer-state bytes the members received from
peers to refill their shards (`reshard_bytes`). It is 0 with full replicas, and on 2
nodes: a member's snapshot keeps its own chunks and a replica of another node's, so a lone
survivor holds all. The epoch that admits the joiner (or the restarted worker) after a
fault is not that fault's recovery and is not counted here. "params" is "equal" when
every faulty run ended with the fault-free run's params_sha256, "DIFFER" when one did not,
"-" when no run reported one. "extra" counts epochs that neither a fault of the run's
kind nor an admission explains (a false alarm, say, on a loaded machine: a timeout fired
while every member answered); they are not errors, but they slow the runs they hit. A
cell whose fault-free run failed shows as such. Every problem a run had (unfinished, other
numbers, lost or repeated samples, faults without a recovery record) is listed below the
table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import mttr  # noqa: E402
from harness.stats import percentile  # noqa: E402

SCRIPT = REPO / "examples" / "transformer.py"
KINDS = ("kill-node", "kill-worker")
SHARDS = ("none", "zero1", "zero2")
SIZES = {  # name: examples/transformer.py's model flags
    "small": ("--d-model", "64", "--layers", "2", "--seq", "32", "--heads", "4"),
    "medium": ("--d-model", "128", "--layers", "2", "--seq", "64", "--heads", "4"),
}


@dataclass(frozen=True)
class Cell:
    """One row of the matrix: a shard setting ("none": full replicas) on a node count."""

    shard: str
    nodes: int

    @property
    def name(self) -> str:
        return f"{self.shard}-{self.nodes}n"


def kind_row(report: dict[str, Any], kind: str) -> dict[str, Any]:
    """One kind's figures in a cell: count, MTTR p50/p95 (s), moved bytes p50."""
    f = report["kinds"].get(kind, {})
    records = f.get("records", [])
    moved = [float(r["reshard_bytes"]) for r in records if r.get("reshard_bytes") is not None]
    return {
        "count": f.get("count", 0),
        "mttr_p50_s": f.get("mttr_p50_s"),
        "mttr_p95_s": f.get("mttr_p95_s"),
        "reshard_bytes_p50": percentile(moved, 0.5),
        "reshard_s_p50": percentile([float(r.get("reshard_s") or 0.0) for r in records], 0.5),
    }


def params_verdict(report: dict[str, Any]) -> str:
    """'equal' if every faulty run ended on the fault-free run's digest, else 'DIFFER';
    '-' when no run reported a digest (they all failed before the end)."""
    runs = [r for f in report["kinds"].values() for r in f.get("runs", [])]
    reported = [r for r in runs if r.get("params_sha256") is not None]
    if not reported:
        return "-"
    return "equal" if all(r["params_match"] for r in reported) else "DIFFER"


def extra_epochs(report: dict[str, Any]) -> int:
    """Epochs in the faulty runs that no fault of the run's kind and no admission explain."""
    return sum(len(r["extra_epochs"]) for f in report["kinds"].values() for r in f["runs"])


# On 2 nodes the faults alternate between the nodes, so each one hits the lone survivor of
# the one before unless that fault's replacement was admitted first. Its recovery would then
# be a cold start (~2 s here), not what the cell measures: worker kills are spaced for the
# restarted worker's start-up (the transformer's step on one member is ~0.07 s), and a lost
# node's replacement joins at once.
TWO_NODE_WORKER_SPACING = 60


def cell_settings(cell: Cell, base: mttr.Settings) -> mttr.Settings:
    """The job of one cell: ``base`` on its node count and shard setting."""
    s = replace(base, nodes=cell.nodes, shard=None if cell.shard == "none" else cell.shard)
    if cell.nodes == 2:
        spacing = max(s.worker_spacing, TWO_NODE_WORKER_SPACING)
        s = replace(s, worker_spacing=spacing, join_after=0)
    return s


def measure_cell(cell: Cell, count: int, base: mttr.Settings, workdir: Path) -> dict[str, Any]:
    """bench/mttr.py's `measure` for both kinds on one cell, with the row to print."""
    s = cell_settings(cell, base)
    try:
        report = mttr.measure(KINDS, count, s, workdir / cell.name)
    except SystemExit as failed:
        # mttr ends the program when the fault-free run fails; here the other cells go on.
        return {"shard": cell.shard, "nodes": cell.nodes, "failed": str(failed.code)}
    row = {kind: kind_row(report, kind) for kind in KINDS}
    return {
        "shard": cell.shard,
        "nodes": cell.nodes,
        "failed": None,
        "kinds": row,
        "params": params_verdict(report),
        "extra_epochs": extra_epochs(report),
        "report": report,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _kind_cells(k: dict[str, Any], wanted: int) -> str:
    n = f"{k['count']}/{wanted}"
    return (
        f"{n:>5} {_ms(k['mttr_p50_s']):>7} {_ms(k['mttr_p95_s']):>7} "
        f"{_bytes(k['reshard_bytes_p50']):>10}"
    )


def print_table(cells: Sequence[dict[str, Any]], wanted: int) -> None:
    block = f"{'n':>5} {'p50 ms':>7} {'p95 ms':>7} {'moved p50':>10}"
    width = len(block)
    print(f"\n{'':13} | {'kill-node':^{width}} | {'kill-worker':^{width}} |")
    print(f"{'shard':<6} {'nodes':>6} | {block} | {block} | params  extra")
    for c in cells:
        head = f"{c['shard']:<6} {c['nodes']:>6} |"
        if c["failed"] is not None:
            print(f"{head} fault-free run failed")
            continue
        kill_node, kill_worker = (_kind_cells(c["kinds"][k], wanted) for k in KINDS)
        print(f"{head} {kill_node} | {kill_worker} | {c['params']:<6} {c['extra_epochs']:>6}")
    problems = [
        f"{c['shard']}, {c['nodes']} nodes: {v}"
        for c in cells
        for v in ([c["failed"]] if c["failed"] else c["report"]["violations"])
    ]
    if problems:
        print("\nPROBLEMS:")
        for p in problems:
            print(f"  {p.splitlines()[0]}")  # the first line; --json has the log tails
    else:
        print(
            "\nevery run: params_sha256 equal to the fault-free run, 0 samples lost, 0 duplicated"
        )


def node_list(value: str) -> list[int]:
    """--nodes-list: comma-separated node counts, each >= 2 (an argparse type)."""
    return [mttr.node_count(v) for v in value.split(",") if v.strip()]


def shard_list(value: str) -> list[str]:
    """--shards: comma-separated among none, zero1, zero2 (an argparse type)."""
    shards = [v.strip() for v in value.split(",") if v.strip()]
    if bad := [v for v in shards if v not in SHARDS]:
        raise argparse.ArgumentTypeError(f"{bad}: allowed are {', '.join(SHARDS)}")
    return shards


def parse_args() -> tuple[argparse.Namespace, mttr.Settings]:
    """The flags, and the job every cell shares (each node count checked now, not after
    hours of runs)."""
    d = mttr.Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes-list", type=node_list, default=[2, 4, 8], help="e.g. 2,4,8")
    parser.add_argument("--shards", type=shard_list, default=list(SHARDS), help="none,zero1,zero2")
    parser.add_argument("--faults-per-kind", type=int, default=3)
    parser.add_argument("--size", choices=list(SIZES), default="small", help="the model")
    parser.add_argument("--global-batch", type=int, default=d.global_batch)
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch)
    parser.add_argument("--node-spacing", type=int, default=d.node_spacing, help="steps")
    parser.add_argument("--worker-spacing", type=int, default=d.worker_spacing, help="steps")
    parser.add_argument(
        "--join-after",
        type=int,
        default=d.join_after,
        help="steps from each node loss to its join (0: at once; the joiner's start-up "
        "then shares the machine's cores with the recovery measured)",
    )
    parser.add_argument("--run-timeout", type=float, default=d.run_timeout, help="s per run")
    parser.add_argument("--workdir", help="keep run directories here (default: a temp dir)")
    parser.add_argument("--json", help="also write every figure and record here")
    args = parser.parse_args()
    if args.faults_per_kind < 1:
        parser.error(f"--faults-per-kind {args.faults_per_kind} must be >= 1")
    try:
        base = replace(
            d,
            script=str(SCRIPT),
            script_args=SIZES[args.size],
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            node_spacing=args.node_spacing,
            worker_spacing=args.worker_spacing,
            join_after=args.join_after,
            run_timeout=args.run_timeout,
        )
        for n in args.nodes_list:
            replace(base, nodes=n)
    except ValueError as error:
        parser.error(str(error))
    return args, base


def main() -> None:
    args, base = parse_args()
    cells = [Cell(shard, n) for shard in args.shards for n in args.nodes_list]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-mttr-matrix-"))
    t0, results = time.monotonic(), []
    try:
        for cell in cells:
            print(f"\n== shard {cell.shard}, {cell.nodes} nodes ({args.size})", flush=True)
            results.append(measure_cell(cell, args.faults_per_kind, base, workdir))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, args.faults_per_kind)
    seconds = round(time.monotonic() - t0, 1)
    print(f"({seconds:.0f} s in all)")
    if args.json:
        out = {
            "script": str(SCRIPT.relative_to(REPO)),
            "size": args.size,
            "script_args": list(SIZES[args.size]),
            "faults_per_kind": args.faults_per_kind,
            "seconds": seconds,
            "cells": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
