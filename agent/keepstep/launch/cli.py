"""`keepstep run`: the command line of one job on one machine, shaped like torchrun's.

    keepstep run --nnodes 2:4 --nproc-per-node auto --global-batch 64 --micro-batch 4 \\
        --steps 200 [--fault kill-node:1@step=50 ...] train.py ARGS...
    keepstep run --nnodes 2 ... -m pkg.train ARGS...

Where it sits: `keepstep.cli` registers the subcommand; `_cmd_run` checks everything it
can before anything starts, in this order: the flags' own values (argparse types from
`keepstep.argtypes`, so a bad one ends the command before torch or etcd could be touched),
the flags against each other, the device count (`devices`), the checkpoint URLs and their
credentials, the etcd binary, then the whole `RunConfig`. Only then does the `Launcher`
start etcd and the nodes. Flags mean what torchrun's do where both have them (`--nnodes`,
`--nproc-per-node`, `--max-restarts`, `-m`); `--nodes`/`--min-nodes` stay as aliases.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepstep.argtypes import checked, int_at_least, seconds, seconds_or_off
from keepstep.errors import ConfigError, KeepstepError
from keepstep.launch.devices import parse_nproc
from keepstep.launch.faults import ALLOWED, parse_fault

if TYPE_CHECKING:
    from keepstep.launch.run_config import RunConfig


def nnodes(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max)."""
    low, sep, high = text.partition(":")
    try:
        lo, hi = (int(low), int(high)) if sep else (int(text), int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be a node count N or MIN:MAX, such as 4 or 2:4"
        ) from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 1 <= MIN <= MAX (as in 2:4)")
    return lo, hi


def register(sub: Any) -> None:
    """Add the `run` subcommand to the `keepstep` parser's subparsers."""
    run = sub.add_parser(
        "run",
        help="train one job locally with simulated nodes",
        description="Train one job on this machine: a private etcd, one agent per simulated "
        "node (each its own process group), scripted faults, a run directory with the events "
        "and summary.json.",
    )
    count, at_least_0 = int_at_least(1), int_at_least(0)
    run.add_argument(
        "--nnodes",
        "--nodes",
        dest="nnodes",
        type=nnodes,
        required=True,
        metavar="N|MIN:MAX",
        help="nodes to start (MAX); with MIN:MAX the job starts with MIN nodes if not all "
        "are ready after --admission-grace (like --min-nodes), and then trains on whatever "
        "nodes survive",
    )
    run.add_argument(
        "--min-nodes",
        type=count,
        metavar="MIN",
        help="the MIN of --nnodes MIN:MAX, given alone [--nnodes]",
    )
    run.add_argument(
        "--admission-grace",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long the first epoch waits for all nodes before it starts with at least "
        "--min-nodes (counted from each agent's start) [30]",
    )
    run.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=parse_nproc,
        default=1,
        metavar="N|auto|gpu",
        help="workers per node: a number, gpu (one per visible CUDA device) or auto (gpu on "
        "a machine with CUDA devices, else 1) [1]",
    )
    run.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=at_least_0,
        default=3,
        metavar="N",
        help="restarts of a crashed worker in a row before its node gives up (a commit "
        "resets the count; survivors train on meanwhile) [3]",
    )
    run.add_argument(
        "--global-batch",
        type=count,
        required=True,
        metavar="SAMPLES",
        help="samples per step, on any world size",
    )
    run.add_argument(
        "--micro-batch",
        type=count,
        required=True,
        metavar="SAMPLES",
        help="samples per micro-batch; --global-batch must be a multiple of it",
    )
    run.add_argument(
        "--steps", type=count, required=True, metavar="N", help="optimizer steps to train"
    )
    run.add_argument("--seed", type=at_least_0, default=0, metavar="N", help="the job's seed [0]")
    run.add_argument(
        "--mode",
        choices=["exact", "fast"],
        default="exact",
        help="exact: bit-identical sums on any world size; fast: float all-reduce [exact]",
    )
    run.add_argument(
        "--balance",
        action="store_const",
        const="speed",
        default="off",
        help="give a slow member fewer micro-batches, from its measured compute time "
        "(keepstep.init(balance='speed')); the numbers stay those of an even split",
    )
    run.add_argument(
        "--drain-slow",
        metavar="BELOW:STEPS",
        help="drain the node of a member slower than BELOW x the median speed for STEPS "
        "committed steps in a row, as a planned change (e.g. 0.25:20; "
        "keepstep.init(drain_slow=...)); never below --min-nodes [off]",
    )
    run.add_argument(
        "--shard",
        choices=["zero1", "zero2"],
        help="shard the optimizer state (keepstep.init(shard=...)): zero1, each member steps "
        "and keeps its own slice; zero2, and only its slice of the reduced gradient; the "
        "numbers stay those of full replicas [full replicas]",
    )
    run.add_argument(
        "--fault",
        action="append",
        type=checked(parse_fault),
        default=[],
        metavar="SPEC",
        help=f"inject a fault when the job reaches a step (repeatable): {ALLOWED}",
    )
    run.add_argument("--summary", metavar="PATH", help="also write the run summary JSON here")
    run.add_argument(
        "--run-dir", metavar="DIR", help="where logs and summary.json go [runs/run-<time>]"
    )
    run.add_argument(
        "--timeout",
        type=seconds,
        default=1800.0,
        metavar="SECONDS",
        help="end the run (exit 1) if it has not finished after this long [1800]",
    )
    run.add_argument(
        "--hang-timeout",
        type=count,
        default=1,
        metavar="SECONDS",
        help="a node whose etcd lease is silent this long is taken for hung [1]",
    )
    run.add_argument(
        "--heartbeat-timeout",
        type=seconds_or_off,
        default=0.5,
        metavar="SECONDS",
        help="a node that misses its neighbours' heartbeats this long is taken for hung; "
        "0: only the lease finds hangs [0.5]",
    )
    run.add_argument(
        "--collective-timeout",
        type=seconds,
        metavar="SECONDS",
        help="how long a worker waits in one collective before it takes a peer for lost "
        "(keepstep.init(collective_timeout=...)); raise it for steps whose members can "
        "arrive that far apart or whose all-reduce takes that long [30]",
    )
    run.add_argument(
        "--checkpoint",
        metavar="URL",
        help="write durable checkpoints here (file://, s3://; any fsspec store)",
    )
    run.add_argument(
        "--checkpoint-every",
        type=at_least_0,
        default=0,
        metavar="K",
        help="steps between durable checkpoints; needs --checkpoint [0: only the last step]",
    )
    run.add_argument(
        "--resume",
        metavar="URL",
        help="continue the job from the newest durable checkpoint under URL",
    )
    run.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="the job's leader writes step.log metrics to DIR as TensorBoard scalars "
        "(needs the tensorboard package in the workers' environment)",
    )
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
        help="members of the run's private etcd; 3 survive the loss of any one [1]",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module: each worker runs `python -m SCRIPT ARGS` (from this "
        "directory), as with torchrun -m",
    )
    from keepstep.raylaunch.cli import add_arguments as add_ray_arguments

    add_ray_arguments(run)  # --backend, --address, --ray-resource, --etcd, --etcd-tls, ...
    run.add_argument("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    run.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments"
    )
    run.set_defaults(func=_cmd_run)


def run_config(args: argparse.Namespace, env: dict[str, str]) -> RunConfig:
    """The checked RunConfig of a parsed command line; raises ConfigError naming the first
    bad value. Nothing is started; no checkpoint is read."""
    from keepstep.agent.durable.storage import check_command_line_url, storage_options_from_env
    from keepstep.launch.devices import resolve_nproc, visible_cuda_devices
    from keepstep.launch.etcd_server import find_etcd
    from keepstep.launch.run_config import RunConfig

    low, high = args.nnodes
    if args.min_nodes is not None and low != high:
        raise ConfigError(
            f"--min-nodes {args.min_nodes} and --nnodes {low}:{high} both give the minimum; "
            "give one"
        )
    min_nodes = args.min_nodes if args.min_nodes is not None else low
    nproc = resolve_nproc(args.nproc_per_node, visible_cuda_devices, env)
    if not args.module and not Path(args.script).is_file():
        raise ConfigError(_missing_script(args.script))
    options = storage_options_from_env(env)
    home = env.get("HOME") or os.path.expanduser("~")
    for flag, url in (("--checkpoint", args.checkpoint), ("--resume", args.resume)):
        if url is not None:
            check_command_line_url(flag, url, options, env, home)
    run_dir = Path(args.run_dir or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}")
    return RunConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        nodes=high,
        nproc_per_node=nproc,
        min_nodes=min_nodes,
        admission_grace=args.admission_grace,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        steps=args.steps,
        seed=args.seed,
        mode=args.mode,
        run_dir=run_dir,
        faults=tuple(args.fault),
        etcd_binary=find_etcd(env),
        timeout=args.timeout,
        checkpoint_url=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        storage_options=options,
        lease_ttl=args.hang_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        warm_spare=args.warm_spare,
        netns=args.netns,
        etcd_members=args.etcd_members,
        module=args.module,
        max_restarts=args.max_restarts,
        balance=args.balance,
        drain_slow=args.drain_slow,
        extra_env={
            **(
                {"KEEPSTEP_TENSORBOARD": str(Path(args.tensorboard).resolve())}
                if args.tensorboard
                else {}
            ),
            **({"KEEPSTEP_SHARD": args.shard} if args.shard else {}),
            **(
                {"KEEPSTEP_COLLECTIVE_TIMEOUT": repr(args.collective_timeout)}
                if args.collective_timeout is not None
                else {}
            ),
        },
    )


def _missing_script(script: str) -> str:
    """The message for a script path that names no file; it points at a shipped example
    of that name (`keepstep files`), if there is one."""
    from keepstep import resources

    text = f"training script {script!r} does not exist"
    try:
        shipped = resources.find(Path(script).name)
    except KeepstepError:  # none of that name, or no shipped files at all
        return text
    return f"{text}; the shipped example of that name is {shipped}"


def _cmd_run(args: argparse.Namespace) -> int:
    from keepstep.launch.run import Launcher

    cfg = run_config(args, dict(os.environ))
    ray_cfg = None
    if args.backend == "ray":
        from keepstep.raylaunch.cli import ray_config

        ray_cfg = ray_config(args)  # its flags checked before ray is imported
    # SIGTERM (a CI timeout, kill) must still end every node the launcher started.
    signal.signal(signal.SIGTERM, _interrupt)
    if ray_cfg is not None:
        from keepstep.raylaunch.cli import run as run_on_ray

        summary = run_on_ray(cfg, ray_cfg, sys.stderr)
    else:
        summary = Launcher(cfg, sys.stderr).run()
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2))
    samples = summary["samples"]
    print(f"run directory: {cfg.run_dir}")
    trained = summary["steps"] or summary.get("committed_steps", 0)  # none finished: committed
    print(f"steps {trained}/{cfg.steps}  params_sha256 {summary['params_sha256']}")
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
    for j in summary.get("joins_unused", []):
        print(
            f"join: node {j['node']}, started at step {j['step']}, trained no step (not admitted "
            "before the job ended)"
        )
    for f in summary["fallbacks"]:
        print(
            f"fallback: epoch {f['epoch']} resumed every member from the durable checkpoint "
            f"of step {f['checkpoint_step']} ({f['rerun_steps']} steps trained again): "
            f"{f['reason']}"
        )
    codes = summary["agent_exit_codes"]
    failures = summary["failures"]  # the verdict: steps, parameters, every agent's exit
    if failures:
        print(
            f"keepstep: error: the job did not finish cleanly (agents: {codes}); see {cfg.run_dir}",
            file=sys.stderr,
        )
        for failure in failures:
            print(f"keepstep: {failure}", file=sys.stderr)
        _show_failure(cfg.run_dir)
    return 1 if failures else 0


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
