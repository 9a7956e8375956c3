"""The `keepstep` command line: the only place the agent side reads the environment.

keepstep run ...        train one job on this machine with simulated nodes (`launch.cli`)
keepstep agent ...      the node agent (what a pod runs; `keepstep run` starts these)
keepstep selfcheck ...  check bit-identical parameters across rank counts
keepstep dashboard ...  a web page for live and finished runs
keepstep chaos ...      seeded fault schedules with invariants
keepstep checkpoint ... list durable checkpoints, or export one as plain state dicts
keepstep files [NAME]   the files shipped with keepstep (examples, scenarios, the CRD)
keepstep --version

Exit status: 0 done, 1 the work failed (a run that did not finish, a violated invariant, a
runtime error), 2 a usage error: a bad flag or value, reported on one line that names the
value and what is allowed, before any process starts and before torch is imported (each
subcommand imports what it needs only once its arguments are checked).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keepstep.argtypes import Parser, int_at_least
from keepstep.errors import ConfigError, KeepstepError

# `keepstep selfcheck` trains this job shape; a rank count needs a micro-batch of its own.
SELFCHECK_GLOBAL_BATCH, SELFCHECK_MICRO_BATCH = 48, 4

# The extra that installs a missing third-party module (pyproject.toml's extras).
EXTRA_OF = {
    "ray": "ray",
    "torch": "train",
    "numpy": "train",
    "numba": "train",
    "xxhash": "train",
    "pyetcd": "train",
    "grpc": "train",
    "google": "train",
    "fsspec": "train",
    "s3fs": "train",
    "opentelemetry": "train",
    "prometheus_client": "train",
    "plotly": "dashboard",
    "kubernetes": "dashboard",
    "kopf": "operator",
}


def _ranks(text: str) -> list[int]:
    limit = SELFCHECK_GLOBAL_BATCH // SELFCHECK_MICRO_BATCH
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of integers such as 1,2,3,4"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: needs at least one rank count")
    for r in values:
        if not 1 <= r <= limit:
            raise argparse.ArgumentTypeError(
                f"ranks={r} must be between 1 and {limit} (the micro-batch count)"
            )
    return values


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    import json

    from keepstep.launch.selfcheck import selfcheck  # imports torch: only when asked to

    runs = selfcheck(
        args.ranks,
        steps=args.steps,
        global_batch=SELFCHECK_GLOBAL_BATCH,
        micro_batch=SELFCHECK_MICRO_BATCH,
        mode=args.mode,
        shard=args.shard,
    )
    # The parameters (the clipped updates included) and the logged loss of every step.
    identical = len({(r.params_sha256, r.loss) for r in runs}) == 1
    if args.json:
        report = [
            {
                "ranks": r.ranks,
                "params_sha256": r.params_sha256,
                "loss": list(r.loss),
                "seconds": round(r.seconds, 2),
                "shard": r.shard,
                "stepped_share": list(r.stepped_share),
            }
            for r in runs
        ]
        print(json.dumps({"runs": report, "identical": identical}))
    else:
        for r in runs:
            last = f"{r.loss[-1]:.6f}" if r.loss else "-"
            held = f" shard={r.shard}" if r.shard else (" unsharded" if args.shard else "")
            print(
                f"ranks={r.ranks:<3}{held} params_sha256={r.params_sha256} last loss={last}  "
                f"({r.seconds:.1f} s)"
            )
        differ = "the rank count" + (" or the sharding" if args.shard else "")
        print("identical" if identical else f"NOT identical: numbers depend on {differ}")
    return 0 if identical else 1


def _cmd_files(args: argparse.Namespace) -> int:
    from keepstep import resources

    if args.name is not None:
        print(resources.find(args.name))
        return 0
    base, names = resources.root(), resources.listing()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {base / name}")
    return 0


def version() -> str:
    """The installed distribution's version when this code is the installed copy, else the
    version in the pyproject.toml of the checkout this code runs from, marked as such."""
    import tomllib
    from importlib import metadata

    here = Path(__file__).resolve()
    try:
        dist = metadata.distribution("keepstep")
        if Path(str(dist.locate_file("keepstep/cli.py"))).resolve() == here:
            return dist.version
    except metadata.PackageNotFoundError:
        pass  # not installed: run from a checkout on PYTHONPATH
    checkout = here.parents[2]  # agent/keepstep/cli.py -> the repository
    try:
        project = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]
        return f"{project['version']} (not installed: the checkout at {checkout})"
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown (neither installed nor in a checkout)"


class _Version(argparse.Action):
    """`--version`; the version is looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"keepstep {version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="keepstep", description="Elastic, fault-tolerant PyTorch training.")
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from keepstep.launch.cli import register as register_run

    register_run(sub)
    from keepstep.agent.node.cli import register as register_agent

    register_agent(sub)
    check = sub.add_parser(
        "selfcheck",
        help="check bit-identical parameters across rank counts",
        description="Train a small job once per rank count, in fresh processes on the CPU, "
        "and compare the final parameters' sha256.",
    )
    check.add_argument(
        "--ranks",
        type=_ranks,
        default=[1, 2, 3, 4],
        help="comma-separated rank counts to compare [1,2,3,4]",
    )
    check.add_argument(
        "--steps", type=int_at_least(1), default=30, help="steps each run trains [30]"
    )
    check.add_argument(
        "--mode",
        choices=["exact", "fast"],
        default="exact",
        help="the reduction to check; fast is expected to differ [exact]",
    )
    check.add_argument(
        "--shard",
        choices=["zero1", "zero2"],
        default=None,
        help="shard the optimizer state in every run, and compare with an unsharded run too",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_selfcheck)
    from keepstep.dashboard.cli import register as register_dashboard

    register_dashboard(sub)
    from keepstep.chaos.cli import register as register_chaos

    register_chaos(sub)
    from keepstep.checkpoint.cli import register as register_checkpoint

    register_checkpoint(sub)
    files = sub.add_parser(
        "files",
        help="list the files shipped with keepstep, or print where one is",
        description="The example scripts, chaos scenarios and the TrainJob CRD shipped with "
        "keepstep, e.g. `keepstep run ... $(keepstep files mlp)` or "
        "`kubectl apply -f $(keepstep files trainjob)`.",
    )
    files.add_argument(
        "name",
        nargs="?",
        help="a shipped file's path (examples/mlp.py), file name or stem (mlp); "
        "without it, list them all",
    )
    files.set_defaults(func=_cmd_files)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as error:
        print(f"keepstep: error: {error}", file=sys.stderr)
        return 2
    except KeepstepError as error:
        print(f"keepstep: error: {error}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as error:
        extra = EXTRA_OF.get((error.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"keepstep: error: keepstep {args.command} needs {error.name}, which is not "
            f"installed: pip install 'keepstep[{extra}]'",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("keepstep: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
