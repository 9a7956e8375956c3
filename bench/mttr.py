"""Time to recover, per fault kind: keepstep's MTTR and its phases, with the numbers checked.

    scripts/env python bench/mttr.py [--faults-per-kind 20]
        [--kinds kill-worker,kill-node,hang-node,drain-node] [--shard zero1|zero2] [--json PATH]
        [--nodes 4] [--script examples/mlp.py] [--script-args "..."]

For each kind it runs `keepstep run` (--nodes, 4 by default; --script, examples/mlp.py by
default, with a small --sleep so a step takes ~0.1 s) with several faults of that kind per
run, until at least N were measured. Every node loss (kill, hang, drain) is followed by a
`join-node`, so the job keeps --nodes or one fewer (a joiner needs ~5 s to start python
and torch and be admitted, hence the spacing); a killed worker is restarted by its agent and
rejoins by itself, and each worker is killed at most `WORKER_RESTARTS` times per run
(`Settings`, the spacing and the flags that set them: harness/mttr_settings.py).

--sleep is examples/mlp.py's own flag, so only that script gets it; any other script gets
just --script-args (split as a shell would) after the job's numbers, which `keepstep run`
passes in the environment. Node losses hit n1, n2, ... in turn, then the joined nodes, so
a joined node is hit nodes-1 node spacings after it joined: with --nodes 2 one spacing
must be long enough for a joiner to be admitted (raise --node-spacing for fast steps). On
2 nodes a node loss leaves one node until the join: `--min-nodes` only gates the first
epoch, and after it the job trains on whatever nodes survive.

The join is scheduled at the same step as its loss, right after it, so it can never be
taken for the cause of that loss's epoch or of the next one, whenever it is admitted (its
admission is a record of its own, reason "admit ...").

Each run is checked against a fault-free run of the same job (same nodes, batch split,
steps, seed; run once, without --sleep, which only waits and never touches the numbers):
the final params_sha256 must be equal and no sample may be lost or duplicated. Prints, per
kind, the count, MTTR p50/p95 and the p50 of each phase and of the rolled-back steps.
With --shard every run (the fault-free one too) shards its optimizer state
(`keepstep run --shard`): the same table, to set beside a run without it.
bench/torchrun_baseline.py calls `measure` for its keepstep figure.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from harness.mttr_settings import (  # noqa: E402  (the benches' job flags, re-exported)
    Settings,
    add_job_args,
    add_settings_args,
    settings_from,
)
from harness.mttr_settings import node_count as node_count  # noqa: E402
from harness.stats import percentile  # noqa: E402

KINDS = ("kill-worker", "kill-node", "hang-node", "drain-node")
PHASES = ("detect_s", "agree_s", "communicator_s", "restore_s", "replan_s")


def fault_schedule(kind: str, count: int, s: Settings) -> list[str]:
    """`count` faults of `kind` as `keepstep run --fault` specs.

    Node losses take the original nodes but n0 and then the joined ones in turn (on 4
    nodes: n1, n2, n3, n4, ...; each joined nodes-1 spacings before it is hit); worker
    kills go round the original nodes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: allowed are {', '.join(KINDS)}")
    specs = []
    for k in range(count):
        if kind == "kill-worker":
            specs.append(
                f"kill-worker:{(k + 1) % s.nodes}@step={s.first_step + k * s.worker_spacing}"
            )
        else:
            step = s.first_step + k * s.node_spacing
            # Listed after the loss: at one step the launcher injects in this order.
            specs.append(f"{kind}:{k + 1}@step={step}")
            specs.append(f"join-node@step={step + s.join_after}")
    return specs


def run_keepstep(
    s: Settings, steps: int, faults: Sequence[str], run_dir: Path, sleep: float | None = None
) -> dict[str, Any]:
    """One `keepstep run`; returns its summary.json plus the exit code and the log tail."""
    argv = [
        sys.executable, "-m", "keepstep", "run",
        "--nodes", str(s.nodes), "--min-nodes", str(s.min_nodes),
        "--global-batch", str(s.global_batch), "--micro-batch", str(s.micro_batch),
        "--steps", str(steps), "--seed", str(s.seed), "--run-dir", str(run_dir),
        "--timeout", str(s.run_timeout),
    ]  # fmt: skip
    if s.shard:
        argv += ["--shard", s.shard]
    for spec in faults:
        argv += ["--fault", spec]
    argv += s.script_argv(sleep)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, timeout=s.run_timeout + 60, check=False
        )
    path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    summary["returncode"] = proc.returncode
    summary["log_tail"] = log.read_text(errors="replace")[-1500:]
    return summary


@dataclass
class KindResult:
    kind: str
    records: list[dict[str, Any]] = field(default_factory=list)
    injected: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        mttr = [r["mttr_s"] for r in self.records]
        return {
            "count": len(self.records),
            "injected": self.injected,
            "mttr_p50_s": percentile(mttr, 0.5),
            "mttr_p95_s": percentile(mttr, 0.95),
            "mttr_max_s": max(mttr, default=None),
            "phase_p50_s": {p: percentile([r[p] for r in self.records], 0.5) for p in PHASES},
            "rolled_back_steps_p50": percentile(
                [float(r["rolled_back_steps"]) for r in self.records], 0.5
            ),
        }


def check_run(summary: dict[str, Any], reference: str | None, steps: int) -> list[str]:
    """What is wrong with one run: unfinished, other numbers, lost or repeated samples."""
    problems = []
    if summary.get("returncode") != 0 or summary.get("steps") != steps:
        problems.append(
            f"exit code {summary.get('returncode')}, {summary.get('steps')}/{steps} steps"
        )
    sha = summary.get("params_sha256")
    if reference is not None and sha != reference:
        problems.append(f"params_sha256 {sha} != fault-free {reference}")
    samples = summary.get("samples", {})
    if samples.get("lost", 1) or samples.get("duplicated", 1):
        problems.append(
            f"samples lost {samples.get('lost')}, duplicated {samples.get('duplicated')}"
        )
    if samples.get("plan_mismatches"):
        problems.append(f"plan mismatches: {samples['plan_mismatches'][:3]}")
    return problems


def reference_sha(s: Settings, steps: int, workdir: Path) -> str:
    """params_sha256 of the fault-free run of this job (sleep 0: same numbers, faster)."""
    summary = run_keepstep(s, steps, [], workdir / f"fault-free-{steps}", sleep=0.0)
    problems = check_run(summary, None, steps)
    if problems or not summary.get("params_sha256"):
        raise SystemExit(f"fault-free run failed: {problems}\n{summary.get('log_tail')}")
    return str(summary["params_sha256"])


def measure_kind(
    kind: str, count: int, s: Settings, workdir: Path, reference: str, max_runs: int
) -> tuple[KindResult, list[str]]:
    """Runs until `count` faults of `kind` have a recovery record (or `max_runs` ran)."""
    result, violations = KindResult(kind), []
    steps, faults = s.steps(kind, count), fault_schedule(kind, s.per_run(kind, count), s)
    for run in range(max_runs):
        if len(result.records) >= count:
            break
        t0 = time.monotonic()
        summary = run_keepstep(s, steps, faults, workdir / f"{kind}-{run}")
        recoveries = summary.get("recoveries", [])
        mine = [r for r in recoveries if r["cause"] == kind and r["mttr_s"] is not None]
        # Epochs neither caused by a fault of this kind nor admitting a joiner: a stall
        # or a second failure inside one recovery.
        extra = [
            r for r in recoveries if r["cause"] != kind and not r["reason"].startswith("admit")
        ]
        injected = sum(1 for f in summary.get("faults", []) if f["kind"] == kind)
        result.records += mine
        result.injected += injected
        world = [w for w in summary.get("world_size_by_step", []) if w]
        problems = check_run(summary, reference, steps)
        sha = summary.get("params_sha256")
        if len(mine) != injected:
            problems.append(f"{injected} {kind} faults injected, {len(mine)} recovery records")
        violations += [f"{kind} run {run}: {p}" for p in problems]
        result.runs.append(
            {
                "run": run,
                "steps": steps,
                "seconds": round(time.monotonic() - t0, 1),
                "injected": injected,
                "measured": len(mine),
                "world_min": min(world, default=0),
                "world_max": max(world, default=0),
                "extra_epochs": extra,
                "admissions": sum(1 for r in recoveries if r["reason"].startswith("admit")),
                "params_sha256": sha,
                "params_match": sha is not None and sha == reference,
                "problems": problems,
            }
        )
        slow = max((r["mttr_s"] for r in mine), default=0.0)
        print(
            f"  {kind} run {run}: {len(mine)}/{injected} measured, world "
            f"{min(world, default=0)}-{max(world, default=0)}, slowest {slow:.2f} s, "
            f"{len(extra)} extra epochs, {time.monotonic() - t0:.0f} s"
            + ("  " + "; ".join(problems) if problems else ""),
            flush=True,
        )
    if len(result.records) < count:
        violations.append(f"{kind}: only {len(result.records)} of {count} faults measured")
    return result, violations


def measure(
    kinds: Sequence[str], count: int, s: Settings, workdir: Path, max_runs: int | None = None
) -> dict[str, Any]:
    """Per kind: the fault-free reference of its run length (once), then faulty runs."""
    t0 = time.monotonic()
    out: dict[str, Any] = {
        "settings": asdict(s),
        "faults_per_kind": count,
        "reference_params_sha256": {},
        "kinds": {},
        "violations": [],
    }
    references: dict[int, str] = out["reference_params_sha256"]
    for kind in kinds:
        steps = s.steps(kind, count)
        if steps not in references:
            t = time.monotonic()
            references[steps] = reference_sha(s, steps, workdir)
            print(
                f"fault-free run, {steps} steps: params_sha256 {references[steps]} "
                f"({time.monotonic() - t:.0f} s)",
                flush=True,
            )
        runs = max_runs or math.ceil(count / s.per_run(kind, count)) + 2
        result, violations = measure_kind(kind, count, s, workdir, references[steps], runs)
        out["kinds"][kind] = {**result.figures(), "runs": result.runs, "records": result.records}
        out["violations"] += violations
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value * 1000:6.0f}"


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{'kind':<12} {'n':>3}  {'MTTR p50':>8} {'p95':>6} (ms) | p50 ms: {'detect':>6} "
        f"{'agree':>6} {'comm':>6} {'restore':>7} {'replan':>6} | rolled back p50"
    )
    for kind, f in report["kinds"].items():
        p = f["phase_p50_s"]
        rolled = f["rolled_back_steps_p50"]
        print(
            f"{kind:<12} {f['count']:>3}  {_ms(f['mttr_p50_s']):>8} {_ms(f['mttr_p95_s'])}"
            f"      |         {_ms(p['detect_s'])} {_ms(p['agree_s'])} "
            f"{_ms(p['communicator_s'])} {_ms(p['restore_s']):>7} {_ms(p['replan_s'])} | "
            f"{'-' if rolled is None else f'{rolled:g}'}"
        )
    if report["violations"]:
        print("\nVIOLATIONS:")
        for v in report["violations"]:
            print(f"  {v}")
    else:
        print(
            "\nevery run: params_sha256 equal to the fault-free run, 0 samples lost, 0 duplicated"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults-per-kind", type=int, default=20)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", help="also write every figure and record here")
    add_job_args(parser)
    add_settings_args(parser)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds {unknown}: allowed are {', '.join(KINDS)}")
    try:
        s = settings_from(args)
    except ValueError as error:
        parser.error(str(error))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-mttr-"))
    try:
        report = measure(kinds, args.faults_per_kind, s, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(report)
    print(f"({report['seconds']:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
