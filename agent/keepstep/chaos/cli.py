"""`keepstep chaos run SCENARIO.yaml --report PATH`: the chaos harness's command line.

`keepstep chaos check REPORT.json` judges the runs of a report again from their run
directories (after the invariants changed), without running anything.

Where it sits: `keepstep.cli.build_parser` calls `register(sub)`; the command loads
the scenario (a mistake is reported with its line), runs it on the local target
(`runner.run_scenario`) and writes the report (`report.write`). `--target ray` runs it
with `keepstep run --backend ray` on a local Ray cluster that it starts and stops
(`keepstep.raylaunch.chaos_target`, imported only then: this package never imports ray),
the reference on the local target. Cluster mode
(`python -m keepstep.e2e.chaos`) reuses `add_run_arguments` and `run_and_report` with
its own target. Exit status: 0 when every
invariant held in every run (or the scenario was skipped, with its reason printed),
1 when an invariant was violated.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstep.errors import ConfigError

if TYPE_CHECKING:
    from keepstep.chaos.model import Scenario
    from keepstep.chaos.target import Target


def register(sub: Any) -> None:
    """Add `chaos` (with `run`) to the `keepstep` subcommands."""
    chaos = sub.add_parser("chaos", help="run seeded fault schedules and check invariants")
    verbs = chaos.add_subparsers(dest="chaos_command", required=True)
    run = verbs.add_parser(
        "run",
        help="run one scenario file",
        epilog="Cluster mode (a TrainJob on the end-to-end cluster): "
        "python -m keepstep.e2e.chaos run SCENARIO.yaml",
    )
    add_run_arguments(run)
    run.add_argument(
        "--target",
        choices=["local", "ray"],
        default="local",
        help="where the runs go: local (keepstep run on this machine) or ray (keepstep run "
        "--backend ray on a local Ray cluster of one raylet per node, started and stopped "
        "here; needs keepstep[ray]) [local]",
    )
    run.set_defaults(func=_cmd_run)
    again = verbs.add_parser(
        "check",
        help="judge the runs of a report again, and fold their recoveries again (nothing is run)",
    )
    again.add_argument("report", help="a report written by `keepstep chaos run`")
    again.add_argument(
        "--write",
        action="store_true",
        help="write the verdicts and recoveries found now into the JSON report (its HTML page "
        "stays as it was written)",
    )
    again.set_defaults(func=_cmd_check)


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """The arguments of `chaos run` that do not depend on the target (the cluster
    mode's command line has them too)."""
    run.add_argument("scenario", help="a scenario file (e2e/scenarios/*.yaml)")
    run.add_argument("--report", help="write the JSON report here (and an .html beside it)")
    run.add_argument("--run-dir", help="where the runs go (default: runs/chaos-<name>-<time>)")
    run.add_argument(
        "--reference-cache",
        help="where fault-free reference runs are cached (default: the run directory)",
    )
    run.add_argument(
        "--only-run",
        type=int,
        action="append",
        metavar="N",
        help="replay only run N of the scenario (repeatable)",
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from keepstep.chaos.local import LocalTarget
    from keepstep.chaos.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    if args.target == "ray":
        return _run_on_ray(scenario, args, LocalTarget())
    return run_and_report(scenario, args, LocalTarget())


def _run_on_ray(scenario: Scenario, args: argparse.Namespace, local: Target) -> int:
    """The scenario on a local Ray cluster, compared with the local target's fault-free
    run; the cluster is stopped at the end, and a process of it left fails the command."""
    from keepstep.launch.etcd_server import find_etcd
    from keepstep.raylaunch.chaos_target import RayTarget  # imports ray

    target = RayTarget(etcd_binary=find_etcd(dict(os.environ)))
    try:
        code = run_and_report(scenario, args, target, reference_target=local)
    finally:
        left = target.close()
    for line in left:
        print(f"  left behind by the Ray cluster: {line}")
    return 1 if left else code


def run_and_report(
    scenario: Scenario,
    args: argparse.Namespace,
    target: Target,
    reference_target: Target | None = None,
) -> int:
    """Run `scenario` on `target` as `args` (from `add_run_arguments`) say, write the
    report and print the verdict; the exit status (0 passed or skipped, 1 violated)."""
    from keepstep.chaos import report
    from keepstep.chaos.runner import run_scenario, summarize

    # SIGTERM (a CI timeout) must still end the run's processes: unwind like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.run_dir or f"runs/chaos-{scenario.name}-{stamp}")
    cache = Path(args.reference_cache) if args.reference_cache else None

    def say(text: str) -> None:
        print(f"chaos: {text}", file=sys.stderr, flush=True)

    only = set(args.only_run) if args.only_run else None
    result = run_scenario(scenario, target, run_dir, cache, only, say, reference_target)
    data = summarize(result)
    path = Path(args.report) if args.report else run_dir / "report.json"
    page = report.write(result, data, path)
    if result.skipped:
        print(f"{scenario.name}: SKIPPED: {result.skipped}")
        return 0
    g = data["goodput"]
    ratio = f"{g['ratio']:.3f}" if g.get("ratio") else "-"
    print(
        f"{scenario.name} ({target.name}): {'PASSED' if result.passed else 'FAILED'}  "
        f"{data['faults_applied']} faults applied, {data['faults_skipped']} skipped, "
        f"{len(data['violations'])} violations, goodput {ratio} of the fault-free run, "
        f"{len(data['unexplained_recoveries'])} recoveries no fault explains"
    )
    for line in data["violations"][:20]:
        print(f"  {line}")
    _print_kinds(data)
    if scenario.known_failure and not result.passed:
        print(f"  known finding: {scenario.known_failure}")
    print(f"report: {path} and {page}")
    return 0 if result.passed else 1


def _cmd_check(args: argparse.Namespace) -> int:
    import json

    from keepstep.chaos.runner import recheck, refold, rejudged
    from keepstep.chaos.scenario import load_scenario

    try:
        data = json.loads(Path(args.report).read_text())
        source = data["source"]
    except OSError as error:
        raise ConfigError(f"report {args.report!r}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"report {args.report!r}: not a report written by `keepstep chaos run`"
        ) from None
    scenario = load_scenario(source)
    verdicts = recheck(data, scenario)
    for run, verdict in zip(data["runs"], verdicts, strict=True):
        state = "holds" if not verdict.violations else f"VIOLATED: {verdict.violations}"
        print(f"run {run['index']}: {state}")
    data = refold(data, scenario)
    print(f"{len(data['unexplained_recoveries'])} recoveries no fault explains")
    _print_kinds(data)
    if args.write:
        data = rejudged(data, verdicts)
        Path(args.report).write_text(json.dumps(data, indent=2, default=str))
        print(f"report: {args.report} rewritten")
    return 0 if all(not v.violations for v in verdicts) else 1


def _print_kinds(data: dict[str, Any]) -> None:
    """The report's MTTR by fault kind, one line each (a scenario of one kind: none)."""
    if len(data["by_kind"]) > 1:
        for name, k in data["by_kind"].items():
            p50, p95 = k["mttr_p50_s"], k["mttr_p95_s"]
            timed = f"MTTR p50 {p50:.2f} s p95 {p95:.2f} s" if p50 is not None else "untimed"
            print(f"  {name:<20} {k['applied']:>4} applied {k['skipped']:>3} skipped  {timed}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
