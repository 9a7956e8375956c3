"""The Ray side of a run, checked whole when it is made.

Where it sits: `cli` builds a `RayConfig` from `--address`, `--ray-resource` and the like
(tests build one directly) and hands it, beside the local backend's `RunConfig`, to
`launcher.RayLauncher`. This module does not import ray: the command line checks its
flags before ray is imported.

`RayFault` is a fault scheduled at a step, injected through Ray with the job held at that
step boundary (the same step gates as `keepstep run --fault`): kill a node's actor, kill
its first worker (through its actor, on its Ray node), remove the Ray node it runs on, or
add a Ray node for the job to grow onto (the caller supplies how to remove and add: a local
cluster can remove and start a raylet, a real cluster cannot from the driver).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from keepstep.errors import ConfigError

# Each node agent's actor reserves this in its bundle unless told otherwise.
DEFAULT_BUNDLE: Mapping[str, float] = {"CPU": 1.0}


class RayFaultKind(enum.Enum):
    KILL_ACTOR = "kill-actor"  # the node's actor process dies (SIGKILL): agent and workers too
    REMOVE_NODE = "remove-node"  # the Ray node the agent runs on goes away, every process
    KILL_WORKER = "kill-worker"  # the node's first worker dies (SIGKILL); its agent restarts it
    ADD_NODE = "add-node"  # a Ray node joins the cluster: the job grows onto it (--nnodes MAX)

    @property
    def needs_node(self) -> bool:
        return self is not RayFaultKind.ADD_NODE


@dataclass(frozen=True)
class RayFault:
    kind: RayFaultKind
    node: int | None  # the job's node index: n<node> (None: add-node, which names none)
    step: int  # injected with exactly this many steps committed

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RayFaultKind):
            allowed = ", ".join(k.value for k in RayFaultKind)
            raise ConfigError(f"ray fault kind {self.kind!r}; allowed: {allowed}")
        if not self.kind.needs_node:
            if self.node is not None:
                raise ConfigError(f"ray fault {self.kind.value} takes no node")
        elif not (isinstance(self.node, int) and self.node >= 0):
            raise ConfigError(f"ray fault node {self.node!r} must be an integer >= 0")
        if not (isinstance(self.step, int) and self.step >= 1):
            raise ConfigError(f"ray fault step {self.step!r} must be an integer >= 1")

    def __str__(self) -> str:
        target = "" if self.node is None else f":{self.node}"
        return f"{self.kind.value}{target}@step={self.step}"


@dataclass(frozen=True)
class RayConfig:
    """`address`: the Ray cluster ("auto", "ray://host:10001", a GCS "host:port"); None
    starts a local one-node Ray (`ray.init()`'s default). `bundle`: what each agent's
    placement bundle (and actor) reserves on its node; a custom resource that each node
    has once (`{"keepstep-node": 1}`) keeps every node to one agent across replacements.
    `etcd`: an etcd the job uses as is ("h:p[,h:p]"; its credentials in `etcd_tls`, a
    folder of ca.crt, tls.crt, tls.key), else the launcher starts one on the driver's
    node. `replace`: a node whose actor died gets a new actor when Ray has room.
    `place_timeout`: how long the placement group may take to be placed."""

    address: str | None = None
    bundle: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_BUNDLE))
    etcd: str | None = None
    etcd_tls: Path | None = None
    replace: bool = True
    place_timeout: float = 120.0
    poll_interval: float = 0.25
    faults: tuple[RayFault, ...] = ()

    def __post_init__(self) -> None:
        if self.address is not None and not self.address.strip():
            raise ConfigError("--address '' names no Ray cluster; use auto, ray://HOST:PORT")
        if not self.bundle:
            raise ConfigError("--ray-resource: the bundle must reserve at least one resource")
        for name, amount in self.bundle.items():
            if not name or not _positive(amount):
                raise ConfigError(
                    f"--ray-resource {name}={amount!r}: needs a name and an amount > 0"
                )
        if self.etcd is not None:
            hosts = [h for h in self.etcd.split(",") if h]
            if not hosts or any(not h.rpartition(":")[2].isdigit() for h in hosts):
                raise ConfigError(f"--etcd {self.etcd!r} must be HOST:PORT[,HOST:PORT...]")
        elif self.etcd_tls is not None:
            raise ConfigError("--etcd-tls is for an etcd given with --etcd")
        for name, value in (
            ("place_timeout", self.place_timeout),
            ("poll_interval", self.poll_interval),
        ):
            if not _positive(value):
                raise ConfigError(f"{name} {value!r} must be a number of seconds > 0")
        on_nodes = [(f.step, f.node) for f in self.faults if f.node is not None]
        if len(set(on_nodes)) != len(on_nodes):
            raise ConfigError(f"ray faults {[str(f) for f in self.faults]}: one per node and step")


def parse_resource(text: str) -> tuple[str, float]:
    """`NAME=AMOUNT` (or `NAME`, amount 1) -> (name, amount)."""
    name, sep, amount = text.partition("=")
    try:
        value = float(amount) if sep else 1.0
    except ValueError:
        raise ConfigError(f"--ray-resource {text!r} must be NAME or NAME=AMOUNT") from None
    if not name or not _positive(value):
        raise ConfigError(f"--ray-resource {text!r} must be NAME or NAME=AMOUNT with AMOUNT > 0")
    return name, value


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
