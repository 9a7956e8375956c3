"""`keepstep agent`: one node agent, as a pod (or `keepstep run`) starts it.

Two ways to configure it:

    keepstep agent --config agent.json                      what `keepstep run` writes
    keepstep agent --nodes 3 --min-nodes 2 --global-batch 64 --micro-batch 4 --steps 200 \\
        -- python train.py ARGS...                          what a TrainJob's pod runs

In the second form the etcd endpoints, job and node come from flags or, as the operator
sets them, from KEEPSTEP_ETCD_ENDPOINTS, KEEPSTEP_JOB, KEEPSTEP_NODE and KEEPSTEP_HOST (the
pod's IP, which peers use to reach this node's probe and process-group store).
KEEPSTEP_ETCD, the endpoints' old name, still works with a warning: `keepstep run` and the
tests used the same name for the etcd binary, now KEEPSTEP_ETCD_BIN. Telemetry
exporters come from KEEPSTEP_TELEMETRY / OTEL_EXPORTER_OTLP_ENDPOINT, an S3-compatible
checkpoint endpoint from KEEPSTEP_S3_ENDPOINT. The environment is read here and nowhere
deeper.

`--resume URL` (what the operator adds when a suspended TrainJob resumes) starts the
workers from the newest durable checkpoint under URL. Unlike `keepstep run --resume`,
finding none is not an error: the job then starts from step 0, since a pod that refused
would only be replaced by another that refuses.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from keepstep.argtypes import int_at_least, seconds, seconds_or_off
from keepstep.errors import ConfigError

# Reading the newest checkpoint record and its blob from object storage.
_RESUME_READ_S = 120.0
ENDPOINTS_ENV = "KEEPSTEP_ETCD_ENDPOINTS"
OLD_ENDPOINTS_ENV = "KEEPSTEP_ETCD"  # deprecated

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    env = os.environ
    count, at_least_0 = int_at_least(1), int_at_least(0)
    agent = sub.add_parser(
        "agent",
        help="run one node agent (what a TrainJob pod runs)",
        description="Run one node agent: its workers, its membership, its snapshots.",
    )
    agent.add_argument("--config", help="agent configuration (JSON), as `keepstep run` writes it")
    agent.add_argument(
        "--etcd",
        metavar="ENDPOINTS",
        help="etcd endpoints, host:port[,host:port...] [$KEEPSTEP_ETCD_ENDPOINTS]",
    )
    agent.add_argument(
        "--etcd-tls",
        metavar="DIR",
        default=env.get("KEEPSTEP_ETCD_TLS_DIR"),
        help="the job's etcd credentials: ca.crt, tls.crt, tls.key [$KEEPSTEP_ETCD_TLS_DIR]",
    )
    agent.add_argument("--job", default=env.get("KEEPSTEP_JOB"), help="job id [$KEEPSTEP_JOB]")
    agent.add_argument(
        "--node",
        default=env.get("KEEPSTEP_NODE") or socket.gethostname(),
        help="this node's id [$KEEPSTEP_NODE, else the host name]",
    )
    agent.add_argument(
        "--host",
        default=env.get("KEEPSTEP_HOST") or "127.0.0.1",
        help="the address peers reach this node on [$KEEPSTEP_HOST]",
    )
    agent.add_argument("--nodes", type=count, help="nodes the job starts with")
    agent.add_argument(
        "--min-nodes",
        type=count,
        help="start with this many nodes if not all are ready after 30 s [--nodes]; once "
        "started, the job trains on whatever nodes survive (the operator fails a TrainJob "
        "that stays below minNodes)",
    )
    agent.add_argument("--nproc", type=count, default=1, help="workers on this node [1]")
    agent.add_argument(
        "--max-restarts",
        type=at_least_0,
        default=3,
        help="restarts of a crashed worker in a row before the agent gives up [3]",
    )
    agent.add_argument("--global-batch", type=count, help="samples per step, on any world size")
    agent.add_argument("--micro-batch", type=count, help="samples per micro-batch")
    agent.add_argument("--steps", type=count, help="optimizer steps to train")
    agent.add_argument("--seed", type=at_least_0, default=0, help="the job's seed [0]")
    agent.add_argument(
        "--mode",
        choices=["exact", "fast"],
        default="exact",
        help="exact: bit-identical sums on any world size; fast: float all-reduce [exact]",
    )
    agent.add_argument(
        "--checkpoint", metavar="URL", help="durable checkpoints (file://, s3://; fsspec URL)"
    )
    agent.add_argument(
        "--checkpoint-every",
        type=at_least_0,
        default=0,
        metavar="K",
        help="steps between durable checkpoints [0: only the last step]",
    )
    agent.add_argument(
        "--resume",
        metavar="URL",
        help="start from the newest durable checkpoint under URL, if there is one",
    )
    agent.add_argument(
        "--hang-timeout",
        type=count,
        default=1,
        metavar="SECONDS",
        help="a node whose etcd lease is silent this long is taken for hung [1]",
    )
    agent.add_argument(
        "--heartbeat-timeout",
        type=seconds_or_off,
        default=0.5,
        metavar="SECONDS",
        help="a neighbouring node that does not answer its heartbeats this long is taken "
        "for hung; 0: only the lease finds hangs [0.5]",
    )
    agent.add_argument(
        "--admission-timeout",
        type=seconds,
        default=3600.0,
        metavar="SECONDS",
        help="how long a worker waits to be admitted (the job's start, a join) before it "
        "gives up [3600]",
    )
    agent.add_argument("--warm-spare", action="store_true", help="keep a warm spare worker")
    agent.add_argument(
        "--termination-log",
        metavar="PATH",
        help="write why the agent failed here (in a pod: /dev/termination-log) [none]",
    )
    agent.add_argument("--run-dir", help="event log and worker logs [a temporary folder]")
    agent.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    agent.set_defaults(func=_cmd_agent)


def _cmd_agent(args: argparse.Namespace) -> int:
    from keepstep.agent.node.config import AgentConfig

    # The configuration is checked whole before the daemon's modules (and etcd's client)
    # are imported: a wrong flag or file is reported at once.
    cfg: AgentConfig = config_file(Path(args.config)) if args.config else from_flags(args)
    from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV

    credentials = EtcdCredentials.from_dir(cfg.etcd_tls) if cfg.etcd_tls else None
    from keepstep.agent.node.main import run_agent
    from keepstep.agent.telemetry.config import TelemetryConfig

    telemetry_cfg = TelemetryConfig.from_env(os.environ)
    telemetry = None
    if telemetry_cfg.enabled:  # OpenTelemetry's SDK takes ~0.3 s to import: only then
        from keepstep.agent.telemetry.otel import create_telemetry

        telemetry = create_telemetry(telemetry_cfg, node=cfg.node, trainjob=cfg.job)
    try:
        code = run_agent(cfg, EtcdKV(cfg.etcd, credentials=credentials), telemetry)
    finally:
        if telemetry is not None:
            telemetry.close()
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the agent's process with `code`, skipping the interpreter's teardown.

    Everything the agent owns is closed by now (its keys deleted, workers stopped, event
    log flushed line by line, telemetry exported). What can remain are daemon threads
    blocked in native code: an abort sent to the store of a node that hangs, a gRPC stream
    being cancelled. Tearing the interpreter down under them can end a process that did
    its work well with SIGABRT ("terminate called without an active exception"), which
    its launcher then counts as a failure. Seen once in a 1,000-fault campaign: a drained
    node's agent, exiting while another node hung."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def config_file(path: Path) -> Any:
    """The AgentConfig in `path` (what `keepstep run` writes); a missing or unreadable file
    is a ConfigError that names it."""
    from keepstep.agent.node.config import load_config

    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file (the agent-*.json a run writes)")
    try:
        return load_config(path)
    except ConfigError:
        raise  # names the file and the field already
    except (ValueError, OSError) as error:  # not JSON, unreadable
        raise ConfigError(f"--config {path}: not an agent configuration ({error})") from None


def from_flags(args: argparse.Namespace) -> Any:
    """The agent configuration of a pod's command line; names every missing value."""
    from keepstep.agent.node.config import AgentConfig, worker_env

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    etcd: str = args.etcd or etcd_endpoints(os.environ) or ""
    missing = [
        flag
        for flag, value in (
            ("--etcd (or KEEPSTEP_ETCD_ENDPOINTS)", etcd),
            ("--job (or KEEPSTEP_JOB)", args.job),
            ("--nodes", args.nodes),
            ("--global-batch", args.global_batch),
            ("--micro-batch", args.micro_batch),
            ("--steps", args.steps),
            ("-- COMMAND", command),
        )
        if not value
    ]
    if missing:
        raise ConfigError(
            "keepstep agent needs --config FILE, or these values: " + ", ".join(missing)
        )
    from keepstep.agent.durable.storage import check_command_line_url, storage_options_from_env

    options = storage_options_from_env(os.environ)
    for flag, url in (("--checkpoint", args.checkpoint), ("--resume", args.resume)):
        if url is not None:
            check_command_line_url(flag, url, options, os.environ, os.path.expanduser("~"))
    if args.checkpoint_every and not args.checkpoint:
        raise ConfigError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint URL")
    run_dir = Path(args.run_dir or Path(tempfile.gettempdir()) / "keepstep" / args.job)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume_step, resume_blob = _resume_point(args.resume, args.steps, options, run_dir, args.node)
    return AgentConfig(
        job=args.job,
        node=args.node,
        etcd=etcd,
        etcd_tls=Path(args.etcd_tls) if args.etcd_tls else None,
        script=command[0],
        command=tuple(command),
        nproc=args.nproc,
        run_dir=run_dir,
        worker_env=worker_env(
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            steps=args.steps,
            seed=args.seed,
            mode=args.mode,
            host=args.host,
        ),
        expected_nodes=args.nodes,
        min_nodes=args.min_nodes or args.nodes,
        lease_ttl=args.hang_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        admission_timeout=args.admission_timeout,
        host=args.host,
        steps=args.steps,
        checkpoint_url=args.checkpoint,
        checkpoint_every=args.checkpoint_every,
        storage_options=options,
        resume_blob=resume_blob,
        resume_step=resume_step,
        warm_spare=args.warm_spare,
        max_restarts=args.max_restarts,
        termination_log=Path(args.termination_log) if args.termination_log else None,
    )


def etcd_endpoints(env: Mapping[str, str]) -> str | None:
    """The etcd endpoints the environment names: $KEEPSTEP_ETCD_ENDPOINTS, else the
    deprecated $KEEPSTEP_ETCD (with a warning that names the new variable)."""
    endpoints, old = env.get(ENDPOINTS_ENV), env.get(OLD_ENDPOINTS_ENV)
    if endpoints:
        return endpoints
    if old:
        log.warning(
            "%s is deprecated as the name of the etcd endpoints; set %s=%s instead",
            OLD_ENDPOINTS_ENV,
            ENDPOINTS_ENV,
            old,
        )
        return old
    return None


def _resume_point(
    url: str | None, steps: int, options: dict[str, Any], run_dir: Path, node: str
) -> tuple[int, Path | None]:
    """The step and blob of the newest checkpoint under `url`; (0, None) when there is none."""
    if not url:
        return 0, None
    from keepstep.agent.durable.reader import latest_checkpoint

    found = latest_checkpoint(url, _RESUME_READ_S, options)
    if found is None:
        print(f"keepstep agent: no checkpoint under {url}; starting from step 0", flush=True)
        return 0, None
    info, blob = found
    if info.step >= steps:
        raise ConfigError(
            f"--resume {url}: the checkpoint is at step {info.step}, not before --steps {steps}"
        )
    path = run_dir / f"resume-{node}.ckpt"
    path.write_bytes(blob)
    print(f"keepstep agent: resuming from step {info.step} ({info.url})", flush=True)
    return info.step, path
