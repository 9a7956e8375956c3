"""`keepstep run --backend ray`: the Ray flags, and `run`, the entry point.

Where it sits: `keepstep.launch.cli` builds the checked `RunConfig` of `keepstep run` as
for the local backend; with `--backend ray` it calls `add_arguments` on its parser
(once, at registration) and, for a run, `ray_config(args)` and `run(cfg, ray_cfg)`
instead of the local `Launcher`. This module imports ray only inside `run`, so a bad
flag is refused before ray is imported. `run` maps `--fault kill-node:N@step=K` to
killing node N's actor and `kill-worker:N@step=K` to that actor killing the node's first
worker; the other fault kinds act on local processes and are refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from keepstep.errors import ConfigError
from keepstep.launch.faults import FaultKind
from keepstep.raylaunch.config import RayConfig, RayFault, RayFaultKind, parse_resource

if TYPE_CHECKING:
    from keepstep.launch.run_config import RunConfig
    from keepstep.raylaunch.faults import AddNode, RemoveNode

BACKENDS = ("local", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `keepstep run` gains for the Ray backend."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="local",
        help="local: simulated nodes on this machine; ray: one agent per Ray node, as a "
        "Ray actor (needs keepstep[ray]) [local]",
    )
    parser.add_argument(
        "--address",
        metavar="ADDR",
        help="with --backend ray: the Ray cluster (auto, ray://HOST:10001, HOST:6379) "
        "[$RAY_ADDRESS, else a local Ray]",
    )
    parser.add_argument(
        "--ray-resource",
        action="append",
        default=[],
        metavar="NAME[=AMOUNT]",
        help="with --backend ray: what each node's agent reserves on its Ray node "
        "(repeatable) [CPU=1]",
    )
    parser.add_argument(
        "--etcd",
        metavar="ENDPOINTS",
        help="with --backend ray: use this etcd (HOST:PORT[,...]) instead of starting one",
    )
    parser.add_argument(
        "--etcd-tls",
        metavar="DIR",
        help="with --etcd: the job's etcd credentials (ca.crt, tls.crt, tls.key)",
    )
    parser.add_argument(
        "--no-replace",
        dest="ray_replace",
        action="store_false",
        help="with --backend ray: do not ask Ray for a new actor when a node is lost",
    )


def ray_config(args: argparse.Namespace, faults: tuple[RayFault, ...] = ()) -> RayConfig:
    """The checked RayConfig of a parsed command line (ConfigError names the bad value)."""
    bundle: dict[str, float] = {}
    for text in args.ray_resource:
        name, amount = parse_resource(text)
        bundle[name] = amount
    return RayConfig(
        address=args.address,
        bundle=bundle or {"CPU": 1.0},
        etcd=args.etcd,
        etcd_tls=Path(args.etcd_tls) if args.etcd_tls else None,
        replace=args.ray_replace,
        faults=faults,
    )


def ray_faults(cfg: RunConfig) -> tuple[RayFault, ...]:
    """`--fault kill-node:N@step=K` and `kill-worker:N@step=K` as Ray faults; other kinds
    are refused."""
    kinds = {
        FaultKind.KILL_NODE: RayFaultKind.KILL_ACTOR,
        FaultKind.KILL_WORKER: RayFaultKind.KILL_WORKER,
    }
    out = []
    for fault in cfg.faults:
        kind = kinds.get(fault.kind)
        if kind is None or fault.node is None:
            raise ConfigError(
                f"--fault {fault}: with --backend ray only kill-node:N@step=K (the node's actor "
                "is killed) and kill-worker:N@step=K (its actor kills the worker)"
            )
        out.append(RayFault(kind, fault.node, fault.step))
    return tuple(out)


def run(
    cfg: RunConfig,
    ray_cfg: RayConfig,
    out: TextIO = sys.stderr,
    remove_node: RemoveNode | None = None,
    add_node: AddNode | None = None,
) -> dict[str, Any]:
    """Run the job on Ray; returns the run summary (also in the run directory). A
    `RunConfig` with `--fault kill-node` faults has them injected through Ray.
    `remove_node` and `add_node`: how the Ray faults that remove or add a Ray node do it
    (a local cluster's raylets; without them those faults are skipped, with a note)."""
    from dataclasses import replace

    from keepstep.raylaunch.launcher import RayLauncher

    if cfg.faults:
        ray_cfg = replace(ray_cfg, faults=ray_cfg.faults + ray_faults(cfg))
        cfg = replace(cfg, faults=())
    return RayLauncher(cfg, ray_cfg, out, remove_node, add_node).run()
