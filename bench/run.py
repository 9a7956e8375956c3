"""keepstep side by side with torchrun, TorchFT and plain DDP: same job, same faults.

    bench/run [--quick] --json PATH [--docs docs/benchmarks.md] [size and schedule flags]

Runs the example transformer (with dropout) under keepstep (`keepstep run`), torchrun
(elastic, restart the world from a checkpoint saved every step), TorchFT (its lighthouse,
gloo) and plain DistributedDataParallel (no faults: the speed reference), with one seeded
fault schedule (kill-node, kill-worker, join-node), the systems' runs interleaved. Prints
one line per run, writes every figure and the ratios keepstep vs each other system to
the JSON file and, with --docs, regenerates the benchmark page and its plots.
`--quick` is the small preset (a few minutes); without it, the full one.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from harness import report
from harness.bench import analyze, execute, load_results
from harness.config import FULL, QUICK, System, config_from_json, with_overrides
from harness.machine import describe_machine


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--quick", action="store_true", help="the small preset")
    parser.add_argument("--json", required=True, metavar="PATH", help="write the figures here")
    parser.add_argument("--docs", metavar="MD", help="regenerate this page and its plots")
    parser.add_argument("--workdir", help="keep every run's logs here (default: a temp dir)")
    parser.add_argument(
        "--from-workdir",
        metavar="DIR",
        help="run nothing: recompute the figures (and --docs) from a workdir kept earlier",
    )
    sizes = parser.add_argument_group("workload and schedule (override the preset)")
    for name in ("d_model", "layers", "heads", "seq", "global_batch", "micro_batch", "steps"):
        sizes.add_argument("--" + name.replace("_", "-"), type=int)
    sizes.add_argument("--seed", type=int, help="data and dropout seed")
    sizes.add_argument("--nodes", type=int, help="nodes each system starts with")
    sizes.add_argument("--min-nodes", type=int, help="nodes a job may shrink to")
    sizes.add_argument("--schedule-seed", type=int)
    sizes.add_argument("--repeats", type=int, help="interleaved rounds of every system")
    sizes.add_argument(
        "--systems", help="comma-separated, from " + ",".join(s.value for s in System)
    )
    sizes.add_argument(
        "--torchft-grad-sync",
        choices=["manager", "ddp"],
        help="TorchFT gradient sum: its Manager's allreduce (default) or its DDP wrapper",
    )
    return parser.parse_args(argv)


def _portable(argv: list[str]) -> list[str]:
    """The arguments as the report shows them: a path outside the repository (a scratch
    folder of the machine it ran on) by its file name only."""
    repo = Path(__file__).resolve().parent.parent
    out = []
    for arg in argv:
        path = Path(arg)
        outside = path.is_absolute() and not path.resolve().is_relative_to(repo)
        out.append(path.name if outside else arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = with_overrides(
            QUICK if args.quick else FULL,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
            seq=args.seq,
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            steps=args.steps,
            seed=args.seed,
            schedule_seed=args.schedule_seed,
            nodes=args.nodes,
            min_nodes=args.min_nodes,
            repeats=args.repeats,
            torchft_grad_sync=args.torchft_grad_sync,
            systems=tuple(System(s) for s in args.systems.split(",")) if args.systems else None,
        )
    except ValueError as error:
        print(f"bench/run: error: {error}", file=sys.stderr)
        return 2
    command = "bench/run " + shlex.join(_portable(sys.argv[1:] if argv is None else argv))
    if args.from_workdir:
        return reanalyze(Path(args.from_workdir), args)
    machine = describe_machine()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"bench/run: {cfg.preset} preset; machine: {machine['summary']}", flush=True)
    started = time.time()
    t0 = time.monotonic()
    try:
        (workdir / "config.json").write_text(json.dumps(cfg.as_json(), indent=2))
        done = execute(cfg, workdir, lambda line: print(line, flush=True))
        seconds = time.monotonic() - t0
        out = {
            "command": command,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "seconds": round(seconds, 1),
            "machine": {**machine, "load_average_after": describe_machine()["load_average"]},
            **analyze(cfg, done),
        }
        (workdir / "header.json").write_text(
            json.dumps({k: out[k] for k in ("command", "started", "seconds", "machine")})
        )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return write(out, args)


def reanalyze(workdir: Path, args: argparse.Namespace) -> int:
    cfg = config_from_json(json.loads((workdir / "config.json").read_text()))
    header = json.loads((workdir / "header.json").read_text())
    out = {**header, **analyze(cfg, load_results(cfg, workdir))}
    return write(out, args)


def write(out: dict[str, object], args: argparse.Namespace) -> int:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(report.summary_text(out), flush=True)
    if args.docs:
        report.write_docs(out, Path(args.docs))
        print(f"wrote {args.docs} and its plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
