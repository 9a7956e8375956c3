"""Fault specs for `keepstep run --fault` and the chaos harness.

    kill-worker:N@step=K   SIGKILL node N's first worker when the job reaches step K
    kill-node:N@step=K     SIGKILL every process of node N (agent and workers)
    hang-node:N@step=K     SIGSTOP every process of node N (it stays stopped)
    drain-node:N@step=K    SIGTERM node N's agent: it leaves at the next step boundary
    join-node@step=K       start one more node
    slow-node:N@step=K:factor=F[,duration=S][,method=M]
                           slow node N down F times (F in (1, 20]) for S seconds (no
                           duration: to the end of the run). M: cgroup (a CPU quota of
                           1/F of a core), signal (the node stopped 1 - 1/F of every
                           0.2 s), auto (cgroup where one can be made, else signal) [auto]

Parsing is pure and names what is wrong; injection acts on process ids the launcher
knows (a node is its agent's process group). Every kind but slow-node changes the
membership (`changes_membership`); a slowed node stays a member and should only get
fewer micro-batches (`keepstep run --balance`).
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from keepstep.errors import ConfigError

SLOW_METHODS = ("auto", "cgroup", "signal")
MAX_FACTOR = 20.0  # a node keeps at least 1/20 of a core: slow, never taken for hung


class FaultKind(enum.Enum):
    KILL_WORKER = "kill-worker"
    KILL_NODE = "kill-node"
    HANG_NODE = "hang-node"
    DRAIN_NODE = "drain-node"
    JOIN_NODE = "join-node"
    SLOW_NODE = "slow-node"

    @property
    def needs_node(self) -> bool:
        return self is not FaultKind.JOIN_NODE

    @property
    def changes_membership(self) -> bool:
        """The job must agree a new membership after it (a slowed node stays a member)."""
        return self is not FaultKind.SLOW_NODE


@dataclass(frozen=True)
class FaultSpec:
    """One fault. `factor`, `duration` and `method` belong to slow-node only: it needs a
    factor; no duration means it lasts to the end of the run."""

    kind: FaultKind
    node: int | None
    step: int
    factor: float | None = None
    duration: float | None = None
    method: str = "auto"

    def __post_init__(self) -> None:
        if self.kind is not FaultKind.SLOW_NODE:
            given = [
                name
                for name, value in (("factor", self.factor), ("duration", self.duration))
                if value is not None
            ] + (["method"] if self.method != "auto" else [])
            if given:
                raise ConfigError(
                    f"{self.kind.value} takes no options (got {', '.join(given)}); "
                    "only slow-node has factor, duration and method"
                )
            return
        f = self.factor
        if f is None:
            raise ConfigError(
                "slow-node needs a factor, as slow-node:N@step=K:factor=3[,duration=10]"
            )
        if not (_number(f) and 1 < f <= MAX_FACTOR):
            raise ConfigError(
                f"slow-node factor {f!r} must be a number in (1, {MAX_FACTOR:g}]: "
                "how many times slower the node runs"
            )
        d = self.duration
        if d is not None and not (_number(d) and d > 0):
            raise ConfigError(f"slow-node duration {d!r} must be a number of seconds > 0")
        if self.method not in SLOW_METHODS:
            raise ConfigError(
                f"slow-node method {self.method!r}; allowed: {', '.join(SLOW_METHODS)}"
            )

    @property
    def share(self) -> float:
        """The share of its speed a slowed node keeps (1 for every other kind)."""
        return 1.0 / self.factor if self.factor is not None else 1.0

    def __str__(self) -> str:
        target = f":{self.node}" if self.node is not None else ""
        text = f"{self.kind.value}{target}@step={self.step}"
        options = [f"factor={self.factor:g}"] if self.factor is not None else []
        if self.duration is not None:
            options.append(f"duration={self.duration:g}")
        if self.method != "auto":
            options.append(f"method={self.method}")
        return f"{text}:{','.join(options)}" if options else text


_SPEC = re.compile(
    r"^(?P<kind>[a-z-]+)(?::(?P<node>\d+))?@step=(?P<step>\d+)(?::(?P<options>.*))?$"
)
ALLOWED = (
    ", ".join(
        f"{k.value}{':N' if k.needs_node else ''}@step=K"
        for k in FaultKind
        if k is not FaultKind.SLOW_NODE
    )
    + ", slow-node:N@step=K:factor=F[,duration=S][,method=auto|cgroup|signal]"
)


def parse_fault(text: str) -> FaultSpec:
    match = _SPEC.match(text.strip())
    if match is None:
        raise ConfigError(
            f"fault {text!r} is not of the form KIND[:NODE]@step=K[:OPTIONS] ({ALLOWED})"
        )
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
    try:
        given = _options(match["options"])
        factor, duration = (_float(given, name) for name in ("factor", "duration"))
        method = given.get("method", "auto")
        return FaultSpec(kind, node, int(match["step"]), factor, duration, method)
    except ConfigError as error:
        raise ConfigError(f"fault {text!r}: {error}") from None


def _float(given: dict[str, str], name: str) -> float | None:
    if name not in given:
        return None
    try:
        return float(given[name])
    except ValueError:
        raise ConfigError(f"{name} {given[name]!r} is not a number") from None


def _options(text: str | None) -> dict[str, str]:
    """`factor=3,duration=10,method=signal` -> {name: value}, names checked."""
    if text is None:
        return {}
    out: dict[str, str] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ConfigError(f"option {item!r} is not NAME=VALUE")
        if name in out:
            raise ConfigError(f"option {name!r} is given twice")
        if name not in ("factor", "duration", "method"):
            raise ConfigError(f"unknown option {name!r}; allowed: factor, duration, method")
        out[name] = value
    return out


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
