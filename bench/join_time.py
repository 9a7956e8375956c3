"""How long a new node takes to join a running job, phase by phase.

    scripts/env python bench/join_time.py [--runs 3] [--nodes 2] [--json PATH]

Runs `keepstep run` (examples/mlp.py, a small --sleep so a step takes ~0.1 s) with a node
asked to join at step 20, and reads the joiner's events. Per run, from the join:

    agent_s    the join -> the new agent started its worker (its interpreter, its imports,
               its connection to etcd)
    ready_s    worker started -> worker ready (it imported torch and keepstep, built the
               model, and said hello to its agent)
    admit_s    worker ready -> the epoch that admits it is agreed (its job built, its
               request to be admitted seen at a step boundary)
    join_s     the join -> the first step committed with it

Each run's params_sha256 must equal the 1-node reference's (printed). The machine's load
moves every figure: compare runs of one invocation, or runs interleaved with another
checkout's (`--label` names them in the output).
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

GLOBAL_BATCH, MICRO_BATCH, JOIN_STEP = 48, 4, 20
PHASES = ("agent_s", "ready_s", "admit_s", "join_s")


def run_once(run_dir: Path, nodes: int, steps: int, sleep: float, join: bool) -> dict[str, Any]:
    flags = ["--nodes", str(nodes), "--global-batch", str(GLOBAL_BATCH)]
    flags += ["--micro-batch", str(MICRO_BATCH), "--steps", str(steps), "--min-nodes", "1"]
    if join:
        flags += ["--fault", f"join-node@step={JOIN_STEP}"]
    script = [str(REPO / "examples" / "mlp.py"), "--sleep", str(sleep)]
    return keepstep_run(flags, script, run_dir, timeout=900)


def phases(run_dir: Path) -> dict[str, float]:
    """The joiner's phases, in seconds (its node is the join fault's)."""
    (fault,) = json.loads((run_dir / "faults.json").read_text())
    node = fault["node"]
    events = [
        {**json.loads(line), "file": path.name}
        for path in run_dir.glob("events-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    mine = [e for e in events if e["file"] == f"events-{node}.jsonl"]

    def first(kind: EventKind, among: list[dict[str, Any]]) -> float:
        return min(e["t"] for e in among if e["kind"] == kind)

    admitting = [e for e in events if any(m.startswith(f"{node}/") for m in e.get("admitted", []))]
    started = first(EventKind.WORKER_STARTED, mine)
    ready = first(EventKind.WORKER_READY, mine)
    return {
        "agent_s": started - fault["t"],
        "ready_s": ready - started,
        "admit_s": first(EventKind.EPOCH_AGREED, admitting) - ready,
        "join_s": first(EventKind.COMMIT, mine) - fault["t"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="nodes training when one joins")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sleep", type=float, default=0.02, help="per micro-batch, seconds")
    parser.add_argument("--label", default="", help="names this checkout in the output")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records: list[dict[str, float]] = []
    shas: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="keepstep-join-") as tmp:
        reference = run_once(Path(tmp) / "reference", 1, args.steps, args.sleep, join=False)
        for i in range(args.runs):
            run_dir = Path(tmp) / f"join-{i}"
            summary = run_once(run_dir, args.nodes, args.steps, args.sleep, join=True)
            shas.add(summary["params_sha256"])
            record = phases(run_dir)
            records.append(record)
            print(
                f"{args.label} run {i}: " + ", ".join(f"{k} {record[k]:.2f}" for k in PHASES),
                flush=True,
            )
    same = shas == {reference["params_sha256"]}
    report: dict[str, Any] = {
        "label": args.label,
        "runs": records,
        "p50": {k: percentile([r[k] for r in records], 0.5) for k in PHASES},
        "params_sha256_equal_reference": same,
    }
    print(
        f"{args.label} p50: " + ", ".join(f"{k} {report['p50'][k]:.2f}" for k in PHASES),
        f"; params_sha256 equal to the 1-node run's: {same}",
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    if not same:
        raise SystemExit("a joined run's parameters differ from the reference's")


if __name__ == "__main__":
    main()
