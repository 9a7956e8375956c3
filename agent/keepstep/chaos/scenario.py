"""Reading a chaos scenario file (YAML) into a `Scenario`, with errors that name the line.

Where it sits: the first step of `keepstep chaos run`; the result goes to `schedule.py`.
The file is composed (not loaded) so that every value keeps its position: a typo in a
key, an unknown fault kind or a value out of range is reported as `FILE:LINE: ...` with
what is allowed there. The format:

    name: kill-worker
    job: {script: examples/mlp.py, nodes: 3, global_batch: 48, micro_batch: 4, steps: 60}
    faults:
      - {kind: kill-worker, node: 1, at: {step: 20}}
      - {kind: kill-node, node: 2, at: {during_recovery_of: 0, delay: 0.05}}
    random: {count: 6, kinds: [kill-worker, slow-node], first_step: 10, min_gap: 8}
    runs: 1
    seed: 7
    checks: {detection_bound_s: 10, min_goodput: 0.95}
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

from keepstep.chaos.model import (
    KIND_NAMES,
    Checks,
    Fault,
    FaultError,
    FaultKind,
    Job,
    RandomFaults,
    Scenario,
    Trigger,
)
from keepstep.errors import ConfigError

T = TypeVar("T")


class ScenarioError(ConfigError):
    """A scenario file is not valid; the message starts with `FILE:LINE:`."""

    def __init__(self, source: str, line: int, message: str) -> None:
        super().__init__(f"{source}:{line}: {message}")
        self.source = source
        self.line = line


_TOP = ("name", "description", "job", "faults", "random", "runs", "seed", "checks", "known_failure")
_JOB = (
    "script",
    "script_args",
    "nodes",
    "nproc_per_node",
    "min_nodes",
    "global_batch",
    "micro_batch",
    "steps",
    "seed",
    "mode",
    "hang_timeout",
    "timeout",
    "checkpoint_every",
    "etcd_members",
    "shard",
)
_FAULT = ("kind", "node", "at", "duration", "method", "cpu", "restart_after", "kill")
_AT = ("step", "time", "during_recovery_of", "delay")
_RANDOM = (
    "count",
    "kinds",
    "first_step",
    "last_step",
    "min_gap",
    "every_s",
    "during_recovery",
    "slow_duration",
    "hang_resume_after",
    "rejoin_steps",
    "hang_methods",
    "partition_duration",
)
_CHECKS = ("detection_bound_s", "shutdown_bound_s", "min_goodput")
_REQUIRED_JOB = ("script", "nodes", "global_batch", "micro_batch", "steps")
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_BOOL = "tag:yaml.org,2002:bool"
_STR = "tag:yaml.org,2002:str"


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; ScenarioError names the line of any mistake."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"scenario {path}: {error.strerror}") from None
    return parse_scenario(text, str(path))


def parse_scenario(text: str, source: str = "<scenario>") -> Scenario:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise ScenarioError(source, line, f"not valid YAML: {error.problem}") from None
    if root is None:
        raise ScenarioError(source, 1, "the file is empty; a scenario needs name, job, faults")
    reader = _Reader(source)
    top = reader.mapping(root, _TOP, "the scenario")
    job_node = reader.require(top, "job", root, "the scenario")
    job = _job(reader, job_node)
    listed = reader.sequence(top["faults"], "faults") if "faults" in top else []
    faults = tuple(_fault(reader, node) for node in listed)
    random = _random(reader, top["random"]) if "random" in top else None
    checks = _checks(reader, top["checks"]) if "checks" in top else Checks()
    name = reader.require(top, "name", root, "the scenario")
    try:
        return _scenario(reader, root, top, name, job, faults, random, checks)
    except FaultError as error:
        raise ScenarioError(source, faults[error.index].line, str(error)) from None


def _scenario(
    reader: _Reader,
    root: yaml.Node,
    top: dict[str, yaml.Node],
    name: yaml.Node,
    job: Job,
    faults: tuple[Fault, ...],
    random: RandomFaults | None,
    checks: Checks,
) -> Scenario:
    source = reader.source
    return reader.build(
        root,
        lambda: Scenario(
            name=reader.str_(name),
            job=job,
            faults=faults,
            random=random,
            runs=reader.int_(top["runs"]) if "runs" in top else 1,
            seed=reader.int_(top["seed"]) if "seed" in top else 0,
            checks=checks,
            description=reader.str_(top["description"]) if "description" in top else "",
            known_failure=reader.str_(top["known_failure"]) if "known_failure" in top else None,
            source=source,
        ),
        passthrough=(FaultError,),
    )


def _job(r: _Reader, node: yaml.Node) -> Job:
    m = r.mapping(node, _JOB, "job")
    for name in _REQUIRED_JOB:
        r.require(m, name, node, "job")
    kw: dict[str, Any] = {}
    for name, value in m.items():
        if name in ("script", "mode", "shard"):
            kw[name] = r.str_(value)
        elif name == "script_args":
            kw[name] = tuple(r.str_(a) for a in r.sequence(value, "script_args"))
        elif name == "timeout":
            kw[name] = r.float_(value)
        else:
            kw[name] = r.int_(value)
    return r.build(node, lambda: Job(**kw))


def _fault(r: _Reader, node: yaml.Node) -> Fault:
    m = r.mapping(node, _FAULT, "a fault")
    kind_node = r.require(m, "kind", node, "a fault")
    kind = r.enum(kind_node, FaultKind, "fault kind", KIND_NAMES)
    at_node = r.require(m, "at", node, f"fault {kind.value}")
    at = r.mapping(at_node, _AT, "at")
    trigger = r.build(
        at_node,
        lambda: Trigger(
            step=r.int_(at["step"]) if "step" in at else None,
            time=r.float_(at["time"]) if "time" in at else None,
            during_recovery_of=(
                r.int_(at["during_recovery_of"]) if "during_recovery_of" in at else None
            ),
            delay=r.float_(at["delay"]) if "delay" in at else 0.0,
        ),
    )
    return r.build(
        node,
        lambda: Fault(
            kind=kind,
            at=trigger,
            node=r.int_(m["node"]) if "node" in m else None,
            duration=r.float_(m["duration"]) if "duration" in m else None,
            method=r.str_(m["method"]) if "method" in m else None,
            cpu=r.float_(m["cpu"]) if "cpu" in m else 0.3,
            restart_after=r.float_(m["restart_after"]) if "restart_after" in m else None,
            kill=r.bool_(m["kill"]) if "kill" in m else True,
            line=node.start_mark.line + 1,
        ),
    )


def _random(r: _Reader, node: yaml.Node) -> RandomFaults:
    m = r.mapping(node, _RANDOM, "random")
    r.require(m, "count", node, "random")
    r.require(m, "kinds", node, "random")
    kinds = tuple(
        r.enum(k, FaultKind, "fault kind", KIND_NAMES) for k in r.sequence(m["kinds"], "kinds")
    )
    opt: dict[str, Any] = {}
    for name in ("first_step", "last_step", "min_gap"):
        if name in m:
            opt[name] = r.int_(m[name])
    for name in (
        "every_s",
        "during_recovery",
        "slow_duration",
        "hang_resume_after",
        "partition_duration",
    ):
        if name in m:
            opt[name] = r.float_(m[name])
    if "rejoin_steps" in m:
        opt["rejoin_steps"] = r.int_(m["rejoin_steps"])
    if "hang_methods" in m:
        methods = r.sequence(m["hang_methods"], "hang_methods")
        opt["hang_methods"] = tuple(r.str_(x) for x in methods)
    return r.build(node, lambda: RandomFaults(count=r.int_(m["count"]), kinds=kinds, **opt))


def _checks(r: _Reader, node: yaml.Node) -> Checks:
    m = r.mapping(node, _CHECKS, "checks")
    return r.build(node, lambda: Checks(**{n: r.float_(v) for n, v in m.items()}))


class _Reader:
    """Typed access to composed YAML nodes; every error carries the node's line."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, node: yaml.Node, message: str) -> ScenarioError:
        return ScenarioError(self.source, node.start_mark.line + 1, message)

    def build(
        self,
        node: yaml.Node,
        make: Callable[[], T],
        passthrough: tuple[type[Exception], ...] = (),
    ) -> T:
        """Construct a dataclass; its validation error gets the line of `node`."""
        try:
            return make()
        except ScenarioError:
            raise
        except ConfigError as error:
            if isinstance(error, passthrough):
                raise
            raise self.fail(node, str(error)) from None

    def mapping(
        self, node: yaml.Node, allowed: tuple[str, ...], where: str
    ) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{where} must be a mapping with keys: {', '.join(allowed)}")
        out: dict[str, yaml.Node] = {}
        for key_node, value in node.value:
            key = self.str_(key_node)
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.fail(
                    key_node,
                    f"unknown key {key!r} in {where}{hint}; allowed: {', '.join(allowed)}",
                )
            if key in out:
                raise self.fail(key_node, f"key {key!r} appears twice in {where}")
            out[key] = value
        return out

    def require(
        self, m: dict[str, yaml.Node], key: str, parent: yaml.Node, where: str
    ) -> yaml.Node:
        if key not in m:
            raise self.fail(parent, f"{where} needs {key!r}")
        return m[key]

    def sequence(self, node: yaml.Node, where: str) -> list[yaml.Node]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, f"{where} must be a list")
        return list(node.value)

    def _scalar(self, node: yaml.Node, tags: tuple[str, ...], what: str) -> str:
        if not isinstance(node, yaml.ScalarNode) or node.tag not in tags:
            shown = node.value if isinstance(node, yaml.ScalarNode) else type(node).__name__
            raise self.fail(node, f"expected {what}, got {shown!r}")
        return str(node.value)

    def str_(self, node: yaml.Node) -> str:
        return self._scalar(node, (_STR, _INT, _FLOAT), "a string")

    def int_(self, node: yaml.Node) -> int:
        text = self._scalar(node, (_INT,), "an integer")
        try:
            return int(text.replace("_", ""), 0)
        except ValueError:
            raise self.fail(node, f"expected an integer, got {text!r}") from None

    def float_(self, node: yaml.Node) -> float:
        text = self._scalar(node, (_INT, _FLOAT), "a number")
        try:
            return float(text.replace("_", ""))
        except ValueError:
            raise self.fail(node, f"expected a number, got {text!r}") from None

    def bool_(self, node: yaml.Node) -> bool:
        return self._scalar(node, (_BOOL,), "true or false").lower() in ("true", "yes", "on")

    def enum(self, node: yaml.Node, cls: type[FaultKind], what: str, allowed: str) -> FaultKind:
        text = self.str_(node)
        try:
            return cls(text)
        except ValueError:
            close = difflib.get_close_matches(text, [k.value for k in cls], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise self.fail(node, f"unknown {what} {text!r}{hint}; allowed: {allowed}") from None
