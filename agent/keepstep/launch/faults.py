"""Fault specs for `keepstep run --fault` and the chaos harness.

    kill-worker:N@step=K   SIGKILL node N's first worker when the job reaches step K
    kill-node:N@step=K     SIGKILL every process of node N (agent and workers)
    hang-node:N@step=K     SIGSTOP every process of node N (it stays stopped)
    drain-node:N@step=K    SIGTERM node N's agent: it leaves at the next step boundary
    join-node@step=K       start one more node

Parsing is pure and names what is wrong; injection acts on process ids the launcher
knows (a node is its agent's process group).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from keepstep.errors import ConfigError


class FaultKind(enum.Enum):
    KILL_WORKER = "kill-worker"
    KILL_NODE = "kill-node"
    HANG_NODE = "hang-node"
    DRAIN_NODE = "drain-node"
    JOIN_NODE = "join-node"

    @property
    def needs_node(self) -> bool:
        return self is not FaultKind.JOIN_NODE


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    node: int | None
    step: int

    def __str__(self) -> str:
        target = f":{self.node}" if self.node is not None else ""
        return f"{self.kind.value}{target}@step={self.step}"


_SPEC = re.compile(r"^(?P<kind>[a-z-]+)(?::(?P<node>\d+))?@step=(?P<step>\d+)$")
ALLOWED = ", ".join(f"{k.value}{':N' if k.needs_node else ''}@step=K" for k in FaultKind)


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if match is None:
        raise ConfigError(f"fault {text!r} is not of the form KIND[:NODE]@step=K ({ALLOWED})")
    try:
        kind = FaultKind(match["kind"])
    except ValueError:
        raise ConfigError(
            f"fault {text!r}: unknown kind {match['kind']!r}; allowed: {ALLOWED}"
        ) from None
    node = int(match["node"]) if match["node"] is not None else None
    if kind.needs_node and node is None:
        raise ConfigError(f"fault {text!r}: {kind.value} needs a node, as {kind.value}:N@step=K")
    if not kind.needs_node and node is not None:
        raise ConfigError(f"fault {text!r}: {kind.value} takes no node, as {kind.value}@step=K")
    return FaultSpec(kind, node, int(match["step"]))


def check_faults(faults: Sequence[FaultSpec], nodes: int, steps: int) -> None:
    """Every fault must name an existing node and happen before the last step."""
    joins = 0
    for fault in sorted(faults, key=lambda f: f.step):
        if fault.step >= steps:
            raise ConfigError(f"fault {fault}: step {fault.step} is not before --steps {steps}")
        if fault.kind is FaultKind.JOIN_NODE:
            joins += 1
        elif fault.node is not None and not 0 <= fault.node < nodes + joins:
            raise ConfigError(
                f"fault {fault}: node {fault.node} does not exist "
                f"(nodes are 0..{nodes + joins - 1})"
            )
