"""MTTR of a killed node on the Ray backend next to the local backend, same job, one run.

    scripts/env python bench/ray_mttr.py [--nodes 4] [--kills 3] [--sleep 0.02] [--json PATH]

Starts a local Ray cluster (a head without CPUs and NODES+1 raylets, each with one
`keepstep-node` resource: the spare takes the replacements), then trains examples/mlp.py
twice with the same nodes, batch split, steps and seed:

- ray:   `keepstep run --backend ray` (`keepstep.raylaunch.cli.run`), the agent's actor of
         node k killed at step s_k (`ray.kill`: the node's agent and workers end with it),
         a replacement actor asked of Ray each time;
- local: `keepstep run` with `--fault kill-node:k@step=s_k` at the same steps, each
         followed by a `join-node` at the same step (the local replacement).

Each run is checked (same params_sha256 on both, no sample lost or duplicated); prints
each backend's MTTR p50 and phases and the ratio ray/local. The Ray cluster is stopped at
the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from keepstep.launch.etcd_server import find_etcd
from keepstep.launch.faults import parse_fault
from keepstep.launch.run import Launcher
from keepstep.launch.run_config import RunConfig
from keepstep.raylaunch.cli import run as ray_run
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "examples" / "mlp.py")
NODE = "keepstep-node"
PHASES = ("detect_s", "agree_s", "communicator_s", "restore_s", "mttr_s")


def run_config(args: argparse.Namespace, run_dir: Path, faults: tuple[str, ...]) -> RunConfig:
    return RunConfig(
        script=MLP,
        script_args=("--sleep", str(args.sleep)),
        nodes=args.nodes,
        min_nodes=2,
        global_batch=args.global_batch,
        micro_batch=4,
        steps=args.steps,
        seed=1,
        run_dir=run_dir,
        etcd_binary=find_etcd(dict(os.environ)),
        faults=tuple(parse_fault(f) for f in faults),
        timeout=900,
    )


def figures(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    samples = summary["samples"]
    ok = not summary["failures"] and samples["lost"] == 0 and samples["duplicated"] == 0
    out: dict[str, Any] = {"backend": name, "ok": ok, "sha": summary["params_sha256"]}
    records = [r for r in summary["recoveries"] if r["cause"] == "kill-node"]
    out["kills"] = len(records)
    for phase in PHASES:
        values = [r[phase] for r in records if r[phase] is not None]
        out[phase] = statistics.median(values) if values else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--spacing", type=int, default=25, help="steps between kills")
    parser.add_argument("--sleep", type=float, default=0.02, help="s per micro-batch")
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    steps_at = [args.spacing * (i + 1) for i in range(args.kills)]
    args.steps = steps_at[-1] + args.spacing
    # Node k dies at the k-th kill (kills < nodes): the survivors and replacements go on.
    kills = [(i % args.nodes, step) for i, step in enumerate(steps_at)]
    work = Path(tempfile.mkdtemp(prefix="ray-mttr-"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(args.nodes + 1):
            cluster.add_node(num_cpus=1, resources={NODE: 1})
        ray.init(address=cluster.address, log_to_driver=False)
        started = time.monotonic()
        faults = tuple(RayFault(RayFaultKind.KILL_ACTOR, n, s) for n, s in kills)
        on_ray = ray_run(
            run_config(args, work / "ray", ()),
            RayConfig(bundle={NODE: 1}, faults=faults),
            io.StringIO(),
        )
        ray_s = time.monotonic() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
    started = time.monotonic()
    # The local backend has no replacements: a node joins at each kill's step, as Ray's
    # replacement actor does, so both keep their node count.
    specs = tuple(f for n, s in kills for f in (f"kill-node:{n}@step={s}", f"join-node@step={s}"))
    local = Launcher(run_config(args, work / "local", specs), io.StringIO()).run()
    local_s = time.monotonic() - started
    rows = [figures("ray", on_ray), figures("local", local)]
    rows[0]["wall_s"], rows[1]["wall_s"] = ray_s, local_s
    same = rows[0]["sha"] == rows[1]["sha"]
    print(f"job: {args.nodes} nodes, {args.steps} steps, kills at {steps_at}; same params: {same}")
    print(f"{'backend':<8}{'ok':>4}{'kills':>6}" + "".join(f"{p:>16}" for p in PHASES))
    for row in rows:
        cells = "".join(
            f"{row[p] * 1000:>14.0f}ms" if row[p] is not None else f"{'-':>16}" for p in PHASES
        )
        print(f"{row['backend']:<8}{row['ok']!s:>4}{row['kills']:>6}{cells}")
    if rows[0]["mttr_s"] and rows[1]["mttr_s"]:
        print(f"MTTR p50 ray/local: {rows[0]['mttr_s'] / rows[1]['mttr_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "same_params": same}, indent=2))
    sys.exit(0 if same and all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
