"""A crashed worker: shrink past it and re-admit it cold, or hand its place to a warm spare?

    scripts/env python bench/warm_spare.py [--runs 3] [--faults-per-run 4] [--json PATH]

Runs the same `keepstep run` job (4 nodes, examples/mlp.py with a small --sleep so a step
takes ~0.1 s) with a worker killed every few steps, alternately without and with
`--warm-spare` so machine drift hits both alike. In both, survivors shrink past the
crash at once (MTTR); what differs is how long the job then trains one worker short:
a cold replacement imports torch before it can ask to be admitted, a warm spare has
already. Per fault it measures

    mttr_s        fault -> first step committed after it (from the run summary)
    ready_s       replacement started -> ready to be admitted (imports done, model built)
    short_s       fault -> first step committed with the full world again
    short_steps   steps committed one worker short

and each run's params_sha256 must equal the fault-free run's (it is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from keepstep.agent.protocol.events import EventKind

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from harness.cli_run import keepstep_run  # noqa: E402
from harness.stats import percentile  # noqa: E402

NODES, GLOBAL_BATCH, MICRO_BATCH = 4, 96, 4


def run_once(
    run_dir: Path, steps: int, faults: list[str], warm: bool, sleep: float
) -> dict[str, Any]:
    flags = ["--nodes", str(NODES), "--global-batch", str(GLOBAL_BATCH)]
    flags += ["--micro-batch", str(MICRO_BATCH), "--steps", str(steps), "--min-nodes", "2"]
    for fault in faults:
        flags += ["--fault", fault]
    if warm:
        flags.append("--warm-spare")
    script = [str(REPO / "examples" / "mlp.py"), "--sleep", str(sleep)]
    return keepstep_run(flags, script, run_dir, timeout=1800)


def measure(run_dir: Path, summary: dict[str, Any]) -> list[dict[str, float]]:
    """One record per injected fault: MTTR, and how long the job trained one short."""
    faults = json.loads((run_dir / "faults.json").read_text())
    commits: dict[int, tuple[float, int]] = {}
    lifecycle: list[dict[str, Any]] = []
    for path in run_dir.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["kind"] == EventKind.COMMIT and event["step"] not in commits:
                commits[event["step"]] = (event["t"], event["world_size"])
            elif event["kind"] in (EventKind.WORKER_STARTED, EventKind.WORKER_READY):
                lifecycle.append(event)
    lifecycle.sort(key=lambda e: e["t"])
    mttr = {r["step"]: r["mttr_s"] for r in summary["recoveries"] if r["cause"] == "kill-worker"}
    out = []
    for fault in faults:
        later = sorted((t, step, w) for step, (t, w) in commits.items() if t > fault["t"])
        full = next(((t, step) for t, step, w in later if w == NODES), None)
        short = [step for t, step, w in later if w < NODES and (full is None or t < full[0])]
        nearest = min(mttr, key=lambda s: abs(s - fault["step"]), default=None)
        # The replacement: started after the fault on the fault's node, then ready (it
        # said hello: imports done, model built, asking to be admitted).
        member = f"{fault['node']}/0"
        mine = [e for e in lifecycle if e["member"] == member and e["t"] > fault["t"]]
        started = next((e["t"] for e in mine if e["kind"] == EventKind.WORKER_STARTED), None)
        ready = next(
            (
                e["t"]
                for e in mine
                if e["kind"] == EventKind.WORKER_READY and e["t"] > (started or 0)
            ),
            None,
        )
        out.append(
            {
                "ready_s": (ready - started) if ready and started else float("nan"),
                "mttr_s": mttr[nearest] if nearest is not None else float("nan"),
                "short_s": (full[0] - fault["t"]) if full else float("nan"),
                "short_steps": float(len(short)),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant")
    parser.add_argument("--faults-per-run", type=int, default=4)
    parser.add_argument("--spacing", type=int, default=150, help="steps between kills")
    parser.add_argument("--sleep", type=float, default=0.02, help="per micro-batch, seconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    steps = args.spacing * (args.faults_per_run + 1)
    faults = [
        f"kill-worker:{1 + i % (NODES - 1)}@step={args.spacing * (i + 1)}"
        for i in range(args.faults_per_run)
    ]
    results: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    shas: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="keepstep-spare-") as tmp:
        for i in range(args.runs):
            for variant in ("cold", "warm"):
                run_dir = Path(tmp) / f"{variant}-{i}"
                summary = run_once(run_dir, steps, faults, variant == "warm", args.sleep)
                shas.add(summary["params_sha256"])
                records = measure(run_dir, summary)
                results[variant] += records
                print(
                    f"{variant} run {i}: "
                    + ", ".join(
                        f"{r['short_s']:.2f}s/{r['short_steps']:.0f} steps" for r in records
                    ),
                    flush=True,
                )
    report: dict[str, Any] = {"params_sha256": sorted(shas), "faults_per_variant": {}}
    for variant, records in results.items():
        row = {
            name: percentile([r[name] for r in records if r[name] == r[name]], 0.5) or float("nan")
            for name in ("mttr_s", "ready_s", "short_s", "short_steps")
        }
        report["faults_per_variant"][variant] = len(records)
        report[variant] = row
        print(
            f"{variant:>4}: {len(records)} kills  MTTR p50 {row['mttr_s']:.3f} s  "
            f"replacement ready p50 {row['ready_s']:.2f} s  "
            f"one worker short p50 {row['short_s']:.2f} s ({row['short_steps']:.0f} steps)"
        )
    print(f"params_sha256 over all runs: {sorted(shas)} (must be one value)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
