"""Throughput with one node throttled, in real training: unweighted vs weighted vs fault-free.

    scripts/env python bench/straggler_run.py [--nodes 4] [--steps 40] [--slow 3]
        [--at-step 2] [--work 100] [--global-batch 48] [--micro-batch 4] [--out DIR]

Three `keepstep run`s of the same job (tests/launch/busy_job.py: a small MLP whose every
micro-batch burns a fixed amount of CPU), each on --nodes nodes:

    fault-free   no fault
    unweighted   `--fault slow-node:1@step=K:factor=F`, the plan splits evenly
    weighted     the same fault with `--balance`: the plan follows measured compute time

The slowed node is held to a CPU quota (a cgroup where one can be made, else a
SIGSTOP/SIGCONT duty cycle, which stops the node whatever it does and so is a poor model of
a straggler for the weighted plan). A quota is a share of one core, and a node of a loaded
machine gets less than a core anyway, so the fault-free run calibrates it: the CPU seconds
one micro-batch's work takes (measured here, on one thread) over the compute seconds a
member took per micro-batch is the share of a core a node got; the quota is that share
divided by --slow (the factor passed, at most 20, is printed). The measured slowdown (the
slowed member's compute seconds per micro-batch over the others', in the unweighted run)
is printed beside it: the machine's load moves between runs, so the two can differ.

Throughput is samples per second between the commits of the first step after the fault and
the last step (the earliest commit of each step in the event logs); "weighted, settled"
starts after the weights changed. The ideal is the fault-free figure times (W-1+1/s)/W,
with s the measured slowdown: what the members' summed speed allows. Every run must end
with the same params_sha256 (printed). Figures from a shared or loaded machine move a lot;
read the ratios of one invocation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "launch" / "busy_job.py"


def _run(args: argparse.Namespace, name: str, extra: list[str], out: Path) -> dict[str, Any]:
    run_dir = out / name
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nnodes", str(args.nodes),
        "--global-batch", str(args.global_batch), "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--seed", "3", "--run-dir", str(run_dir),
        "--timeout", str(args.timeout), *extra, str(JOB), "--work", str(args.work),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 60)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    commits = [
        json.loads(line)
        for path in run_dir.glob("events-*.jsonl")
        for line in path.read_text().splitlines()
        if '"commit"' in line
    ]
    summary["_commits"] = [c for c in commits if c["kind"] == "commit"]
    return summary


def _rate(summary: dict[str, Any], first: int, global_batch: int) -> float:
    """Samples per second from the commit of step `first` to that of the last step."""
    done: dict[int, float] = {}
    for c in summary["_commits"]:
        step = int(c["step"])
        done[step] = min(done.get(step, c["t"]), c["t"])
    last = max(done)
    if last <= first:
        return float("nan")
    return (last - first) * global_batch / (done[last] - done[first])


def _slowdown(summary: dict[str, Any], after: int, slowed: str) -> float:
    """The slowed member's compute seconds per micro-batch over the others' median."""
    per: dict[str, list[float]] = {}
    for c in summary["_commits"]:
        if int(c["step"]) > after and c["micro_batches"]:
            per.setdefault(c["member"], []).append(c["compute_s"] / len(c["micro_batches"]))
    mine = statistics.median(per.pop(slowed))
    return mine / statistics.median([statistics.median(v) for v in per.values()])


def _cpu_per_micro_batch(work: int) -> float:
    """CPU seconds of one micro-batch's extra work on one thread (the MLP's is tiny)."""
    import torch

    spec = importlib.util.spec_from_file_location("busy_job", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    burn: Callable[[int], float] = module.burn
    torch.set_num_threads(1)
    burn(work)  # warm up
    start = time.process_time()
    for _ in range(5):
        burn(work)
    return (time.process_time() - start) / 5


def _wall_per_micro_batch(summary: dict[str, Any]) -> float:
    """The median of the members' compute seconds per micro-batch."""
    return float(
        statistics.median(
            c["compute_s"] / len(c["micro_batches"])
            for c in summary["_commits"]
            if c["micro_batches"]
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow", type=float, default=3.0, help="the slowed node's slowdown")
    parser.add_argument("--at-step", type=int, default=2, help="the step the slowdown starts")
    parser.add_argument("--work", type=int, default=100, help="busy_job.py --work")
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", help="keep the run directories here [a temporary one]")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        free = _run(args, "fault-free", [], out)
        got = _cpu_per_micro_batch(args.work) / _wall_per_micro_batch(free)
        factor = round(min(max(args.slow / min(got, 1.0), 1.01), 20.0), 2)
        fault = f"slow-node:1@step={args.at_step}:factor={factor:g}"
        print(
            f"{args.nodes} nodes on {cores} cores; a node got {got:.2f} of a core fault-free; "
            f"fault {fault} (a quota of 1/{factor:g} core)"
        )
        even = _run(args, "unweighted", ["--fault", fault], out)
        weighted = _run(args, "weighted", ["--fault", fault, "--balance"], out)
    after = args.at_step + 1
    gb = args.global_batch
    slowdown = _slowdown(even, after, "n1/0")
    w = args.nodes
    ideal_share = (w - 1 + 1 / slowdown) / w
    base = _rate(free, after, gb)
    changes = weighted["weight_changes"]
    settled = int(changes[0]["step"]) + 1 if changes else None
    method = even["faults"][0].get("method")
    print(f"slowdown measured (unweighted, compute s per micro-batch): {slowdown:.2f}x ({method})")
    print(f"ideal (W-1+1/s)/W = {ideal_share:.3f} of fault-free")
    rows = [
        ("fault-free", base),
        ("unweighted", _rate(even, after, gb)),
        ("weighted, all steps", _rate(weighted, after, gb)),
    ]
    if settled is not None:
        rows.append((f"weighted, from step {settled}", _rate(weighted, settled, gb)))
    print(f"{'run':<26} {'samples/s':>10} {'x fault-free':>13} {'x ideal':>8}")
    for name, rate in rows:
        print(f"{name:<26} {rate:>10.1f} {rate / base:>13.3f} {rate / base / ideal_share:>8.3f}")
    for c in changes:
        new = {m: round(v, 2) for m, v in c["new"].items()}
        print(f"weights changed after step {c['step']}: {new}")
    spans = weighted["micro_batches_by_step"]
    print("weighted micro_batches_by_step:", json.dumps(spans))
    shas = {s["params_sha256"] for s in (free, even, weighted)}
    print(f"params_sha256 equal in all three runs: {len(shas) == 1} ({sorted(shas)[0][:16]}...)")


if __name__ == "__main__":
    main()
