"""The `keepstep` command line: the only place the agent side reads the environment.

keepstep run ...        train one job on this machine with simulated nodes
keepstep agent ...      the node agent (what a pod runs; `keepstep run` starts these)
keepstep selfcheck ...  check bit-identical parameters across rank counts
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from keepstep.errors import KeepstepError


def _ranks(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--ranks {text!r}: expected a comma-separated list of integers such as 1,2,3,4"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("--ranks needs at least one rank count")
    return values


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from keepstep.launch.selfcheck import selfcheck  # imports torch: only when asked to

    runs = selfcheck(args.ranks, steps=args.steps, mode=args.mode)
    identical = len({r.params_sha256 for r in runs}) == 1
    if args.json:
        print(
            json.dumps(
                {
                    "runs": [
                        {
                            "ranks": r.ranks,
                            "params_sha256": r.params_sha256,
                            "seconds": round(r.seconds, 2),
                        }
                        for r in runs
                    ],
                    "identical": identical,
                }
            )
        )
    else:
        for r in runs:
            print(f"ranks={r.ranks:<3} params_sha256={r.params_sha256}  ({r.seconds:.1f} s)")
        print("identical" if identical else "NOT identical: numbers depend on the rank count")
    return 0 if identical else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from keepstep.agent.durable.storage import storage_options_from_env
    from keepstep.launch.etcd_server import find_etcd
    from keepstep.launch.faults import parse_fault
    from keepstep.launch.run import Launcher, RunConfig

    run_dir = Path(args.run_dir or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = RunConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        min_nodes=args.min_nodes or args.nodes,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        steps=args.steps,
        seed=args.seed,
        mode=args.mode,
        run_dir=run_dir,
        faults=tuple(parse_fault(f) for f in args.fault),
        etcd_binary=find_etcd(os.environ),
        timeout=args.timeout,
        checkpoint_url=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        storage_options=storage_options_from_env(os.environ),
        lease_ttl=args.hang_timeout,
        warm_spare=args.warm_spare,
        netns=args.netns,
        etcd_members=args.etcd_members,
    )
    # SIGTERM (a CI timeout, kill) must still end every node the launcher started.
    signal.signal(signal.SIGTERM, _interrupt)
    summary = Launcher(cfg, sys.stderr).run()
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    samples = summary["samples"]
    print(f"run directory: {run_dir}")
    print(f"steps {summary['steps']}/{cfg.steps}  params_sha256 {summary['params_sha256']}")
    print(
        f"samples: {samples['seen_once']} of {samples['expected']} once, "
        f"{samples['lost']} lost, {samples['duplicated']} duplicated"
    )
    for r in summary["recoveries"]:
        mttr = f"{r['mttr_s']:.3f} s" if r["mttr_s"] is not None else "-"
        print(
            f"recovery: {r['cause']:<12} node {r['node']}  step {r['step']}  MTTR {mttr}  "
            f"(detect {r['detect_s']:.3f}, agree {r['agree_s']:.3f}, communicator "
            f"{r['communicator_s']:.3f}, restore {r['restore_s']:.3f})"
        )
    codes = summary["agent_exit_codes"]
    ok = summary["params_sha256"] is not None and summary["steps"] == cfg.steps
    if not ok:
        print(
            f"keepstep: error: the job did not finish cleanly (agents: {codes}); see {run_dir}",
            file=sys.stderr,
        )
        _show_failure(run_dir)
    return 0 if ok else 1


def _show_failure(run_dir: Path) -> None:
    """Print the end of the first worker or agent log that holds a traceback."""
    for log in sorted(run_dir.glob("worker-*.log")) + sorted(run_dir.glob("agent-*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            tail = text[text.rindex("Traceback") :].splitlines()[-12:]
            print(f"--- {log.name}:\n" + "\n".join(tail), file=sys.stderr)
            return


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keepstep", description="Elastic PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one job locally with simulated nodes")
    run.add_argument("--nodes", type=int, required=True)
    run.add_argument("--nproc-per-node", type=int, default=1)
    run.add_argument(
        "--min-nodes",
        type=int,
        help="start with this many nodes if not all are ready after 30 s [--nodes]; once "
        "started, the job trains on whatever nodes survive",
    )
    run.add_argument("--global-batch", type=int, required=True)
    run.add_argument("--micro-batch", type=int, required=True)
    run.add_argument("--steps", type=int, required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--mode", choices=["exact", "fast"], default="exact")
    run.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="e.g. kill-node:1@step=20 (repeatable)",
    )
    run.add_argument("--summary", help="also write the run summary JSON here")
    run.add_argument("--run-dir", help="default: runs/run-<time>")
    run.add_argument("--timeout", type=float, default=1800.0)
    run.add_argument(
        "--hang-timeout",
        type=int,
        default=1,
        metavar="SECONDS",
        help="a node silent this long (its etcd lease) is taken for hung",
    )
    run.add_argument(
        "--checkpoint",
        metavar="URL",
        help="write durable checkpoints here (file://, s3://; any fsspec URL)",
    )
    run.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="K",
        help="steps between durable checkpoints (default: only the last step)",
    )
    run.add_argument("--resume", metavar="URL", help="continue the job from this checkpoint URL")
    run.add_argument(
        "--warm-spare",
        action="store_true",
        help="keep a process per node with torch imported, to replace a crashed worker fast",
    )
    run.add_argument(
        "--netns",
        action="store_true",
        help="run each node in its own network namespace on a bridge, so that one node can "
        "be cut off the network (needs root and iproute2's `ip`)",
    )
    run.add_argument(
        "--etcd-members",
        type=int,
        choices=[1, 3],
        default=1,
        help="members of the run's private etcd; 3 survive the loss of any one (default 1)",
    )
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=_cmd_run)
    from keepstep.agent.node.cli import register as register_agent

    register_agent(sub)
    check = sub.add_parser("selfcheck", help="check bit-identical parameters across rank counts")
    check.add_argument("--ranks", type=_ranks, default=[1, 2, 3, 4])
    check.add_argument("--steps", type=int, default=30)
    check.add_argument("--mode", choices=["exact", "fast"], default="exact")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_selfcheck)
    from keepstep.dashboard.cli import register as register_dashboard

    register_dashboard(sub)
    from keepstep.chaos.cli import register as register_chaos

    register_chaos(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeepstepError as error:
        print(f"keepstep: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("keepstep: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
