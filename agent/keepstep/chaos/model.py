"""What a chaos scenario says, as frozen dataclasses validated at construction.

Where it sits: `scenario.py` reads a YAML file into these types; `schedule.py` expands them
into the concrete faults of each run; `runner.py` runs them against a target; the checks
(`invariants.py`) use `Checks`. Nothing here reads files or starts processes.

A fault fires on one trigger: a committed step (`step`), seconds after the job's first
commit (`time`), or as soon as the run notices an earlier fault of the same list
(`during_recovery_of`, an index), which puts a second fault inside a recovery.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from keepstep.errors import ConfigError
from keepstep.launch.faults import FaultKind as LauncherKind
from keepstep.launch.faults import FaultSpec


class FaultError(ConfigError):
    """A fault of the scenario's list is invalid in context; `index` says which one."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


class FaultKind(enum.Enum):
    """Every fault a scenario can name. The first five are the launcher's own kinds
    (`keepstep.launch.faults.FaultKind`), taken from it by value; `_LAUNCHER` below is built
    from that enum, so a kind the launcher gains and this list lacks fails at import. The
    rest only the chaos injector (or a cluster target) applies."""

    KILL_WORKER = LauncherKind.KILL_WORKER.value
    KILL_NODE = LauncherKind.KILL_NODE.value
    HANG_NODE = LauncherKind.HANG_NODE.value
    DRAIN_NODE = LauncherKind.DRAIN_NODE.value
    JOIN_NODE = LauncherKind.JOIN_NODE.value
    SLOW_NODE = "slow-node"
    CORRUPT_SNAPSHOT = "corrupt-snapshot"
    KILL_ETCD = "kill-etcd"
    PARTITION_NODE = "partition-node"
    RESTART_OPERATOR = "restart-operator"

    @property
    def launcher_kind(self) -> LauncherKind | None:
        """The launcher's own kind of the same name (None: the injector's only)."""
        return _LAUNCHER.get(self)

    @property
    def needs_node(self) -> bool:
        own = self.launcher_kind
        if own is not None:
            return own.needs_node
        return self not in (FaultKind.KILL_ETCD, FaultKind.RESTART_OPERATOR)

    @property
    def launcher_native(self) -> bool:
        """`keepstep run --fault` can inject it itself (at a step)."""
        return self in _LAUNCHER

    @property
    def expects_recovery(self) -> bool:
        """The job must agree a new membership after it (a failure or a planned change)."""
        return self in _RECOVERING

    @property
    def removes_node(self) -> bool:
        return self in (FaultKind.KILL_NODE, FaultKind.HANG_NODE, FaultKind.DRAIN_NODE)


# ValueError at import if the launcher has a kind the chaos list lacks.
_SAME_NAME = {FaultKind(kind.value): kind for kind in LauncherKind}
# The kinds handed to `keepstep run --fault`: those that change the membership. The
# launcher's slow-node (a node slowed, not lost) stays the injector's, with its methods.
_LAUNCHER = {k: own for k, own in _SAME_NAME.items() if own.changes_membership}
_RECOVERING = frozenset(_LAUNCHER) | {FaultKind.CORRUPT_SNAPSHOT, FaultKind.PARTITION_NODE}
KIND_NAMES = ", ".join(k.value for k in FaultKind)
SLOW_METHODS = ("auto", "cgroup", "signal")
HANG_METHODS = ("signal", "freezer")
# kill-node by removing the Ray node (its raylet and every process on it): the Ray target's
# way; elsewhere the same as a plain kill-node (every process of the node dies by SIGKILL).
KILL_METHODS = ("ray-node",)


@dataclass(frozen=True)
class Trigger:
    step: int | None = None
    time: float | None = None
    during_recovery_of: int | None = None
    delay: float = 0.0

    def __post_init__(self) -> None:
        given = [n for n in ("step", "time", "during_recovery_of") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ConfigError(
                f"a trigger needs exactly one of step, time, during_recovery_of (got {given})"
            )
        if self.step is not None and self.step < 1:
            raise ConfigError(f"step {self.step} must be >= 1 (the job must have started)")
        if self.time is not None and self.time < 0:
            raise ConfigError(f"time {self.time} must be >= 0 seconds")
        if self.during_recovery_of is not None and self.during_recovery_of < 0:
            raise ConfigError(f"during_recovery_of {self.during_recovery_of} must be >= 0")
        if self.delay < 0:
            raise ConfigError(f"delay {self.delay} must be >= 0 seconds")

    def __str__(self) -> str:
        if self.step is not None:
            return f"step={self.step}"
        if self.time is not None:
            return f"time={self.time:g}s"
        return f"during-recovery-of=#{self.during_recovery_of}+{self.delay:g}s"


@dataclass(frozen=True)
class Fault:
    """One fault. `duration` bounds slow-node, partition-node and a hang that resumes;
    `cpu` is the share a slowed node keeps; `restart_after` brings a killed etcd back;
    `method` is how a slow-node, hang-node or kill-node is done (KILL_METHODS)."""

    kind: FaultKind
    at: Trigger
    node: int | None = None
    duration: float | None = None
    method: str | None = None
    cpu: float = 0.3
    restart_after: float | None = None
    kill: bool = True  # corrupt-snapshot: kill the worker so its replacement must load it
    line: int = 0  # where the scenario file says it (0: generated)

    def __post_init__(self) -> None:
        k = self.kind.value
        if self.kind.needs_node and self.node is None:
            raise ConfigError(f"{k} needs a node (node: N)")
        if not self.kind.needs_node and self.node is not None:
            raise ConfigError(f"{k} takes no node")
        if self.node is not None and self.node < 0:
            raise ConfigError(f"node {self.node} must be >= 0")
        if self.kind is FaultKind.JOIN_NODE and self.at.step is None:
            raise ConfigError("join-node fires at a step only (the launcher starts the node)")
        if self.duration is not None and not self.duration > 0:
            raise ConfigError(f"duration {self.duration} must be > 0 seconds")
        if self.kind is FaultKind.SLOW_NODE:
            if self.duration is None:
                raise ConfigError("slow-node needs a duration (seconds)")
            if not 0.05 <= self.cpu < 1:
                raise ConfigError(f"cpu {self.cpu} must be in [0.05, 1): the share the node keeps")
        if self.kind is FaultKind.PARTITION_NODE and self.duration is None:
            raise ConfigError("partition-node needs a duration (seconds)")
        allowed = {
            FaultKind.SLOW_NODE: SLOW_METHODS,
            FaultKind.HANG_NODE: HANG_METHODS,
            FaultKind.KILL_NODE: KILL_METHODS,
        }
        if self.method is not None and self.method not in allowed.get(self.kind, ()):
            options = ", ".join(allowed.get(self.kind, ())) or "none"
            raise ConfigError(f"method {self.method!r} for {k}; allowed: {options}")
        if self.restart_after is not None:
            if self.kind is not FaultKind.KILL_ETCD:
                raise ConfigError(f"restart_after is for kill-etcd, not {k}")
            if not self.restart_after > 0:
                raise ConfigError(f"restart_after {self.restart_after} must be > 0 seconds")

    @property
    def native(self) -> bool:
        """`keepstep run --fault` injects it (rather than the chaos injector)."""
        return (
            self.kind.launcher_native
            and self.at.step is not None
            and self.method is None
            and self.duration is None
        )

    def spec(self) -> str:
        """The `keepstep run --fault` form (meaningful when `native`)."""
        kind = self.kind.launcher_kind
        if kind is None or self.at.step is None:
            return str(self)
        return str(FaultSpec(kind, self.node, self.at.step))

    def __str__(self) -> str:
        target = f":{self.node}" if self.node is not None else ""
        return f"{self.kind.value}{target}@{self.at}"


@dataclass(frozen=True)
class Job:
    """The training job every run of a scenario starts (`keepstep run` arguments)."""

    script: str
    nodes: int
    global_batch: int
    micro_batch: int
    steps: int
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    min_nodes: int = 1
    seed: int = 0
    mode: str = "exact"
    hang_timeout: int = 1
    timeout: float = 300.0
    # > 0: durable checkpoints every K steps, whose hashes locate where a run's numbers
    # first left the fault-free run's (the checkpoint holds the whole training state).
    checkpoint_every: int = 0
    etcd_members: int = 1  # 3: the run's etcd is a cluster that survives losing a member
    # "zero1"/"zero2": the optimizer state is sharded (`keepstep run --shard`); the fault-free
    # reference is run with full replicas, so a run must end with their numbers.
    shard: str | None = None

    def __post_init__(self) -> None:
        if self.etcd_members not in (1, 3):
            raise ConfigError(f"etcd_members {self.etcd_members}; allowed: 1, 3")
        if self.shard not in (None, "zero1", "zero2"):
            raise ConfigError(
                f"shard {self.shard!r}; allowed: zero1, zero2 (or none: full replicas)"
            )
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every {self.checkpoint_every} must be >= 0")
        for name in ("nodes", "global_batch", "micro_batch", "steps", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} {getattr(self, name)} must be >= 1")
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"global_batch {self.global_batch} is not a multiple of micro_batch "
                f"{self.micro_batch}"
            )
        if not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"min_nodes {self.min_nodes} must be between 1 and nodes")
        if self.mode not in ("exact", "fast"):
            raise ConfigError(f"mode {self.mode!r}; allowed: exact, fast")
        if self.hang_timeout < 1 or not self.timeout > 0:
            raise ConfigError(
                f"hang_timeout {self.hang_timeout} must be >= 1 and timeout {self.timeout} > 0"
            )

    @property
    def n_micro(self) -> int:
        return self.global_batch // self.micro_batch


@dataclass(frozen=True)
class RandomFaults:
    """Seeded faults added to every run: either by step (`first_step`..`last_step`, at
    least `min_gap` steps apart) or by time (one every `every_s` seconds)."""

    count: int
    kinds: tuple[FaultKind, ...]
    first_step: int = 5
    last_step: int = 0  # 0: the job's steps minus a margin
    min_gap: int = 5
    every_s: float | None = None
    during_recovery: float = 0.0  # chance that a fault lands inside the previous recovery
    slow_duration: float = 2.0
    hang_resume_after: float | None = None  # hangs resume after this long (else they stay)
    # Step-driven only: a node whose member a fault took out (and not for good) may be hit
    # again this many steps later (None: never in the same run).
    rejoin_steps: int | None = None
    hang_methods: tuple[str, ...] = ()  # drawn per hang (empty: the launcher's SIGSTOP)
    partition_duration: float = 3.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"random count {self.count} must be >= 1")
        if not self.kinds:
            raise ConfigError(f"random kinds must name at least one of: {KIND_NAMES}")
        for kind in self.kinds:
            if kind is FaultKind.RESTART_OPERATOR:
                raise ConfigError(f"random kinds: {kind.value} cannot be drawn at random")
        for method in self.hang_methods:
            if method not in HANG_METHODS:
                raise ConfigError(f"hang_methods: {method!r}; allowed: {', '.join(HANG_METHODS)}")
        if self.rejoin_steps is not None and self.rejoin_steps < 1:
            raise ConfigError(f"rejoin_steps {self.rejoin_steps} must be >= 1")
        if not self.partition_duration > 0:
            raise ConfigError(f"partition_duration {self.partition_duration} must be > 0 seconds")
        if self.first_step < 1 or self.min_gap < 1:
            raise ConfigError(f"first_step {self.first_step} and min_gap {self.min_gap} >= 1")
        if self.every_s is not None and not self.every_s > 0:
            raise ConfigError(f"every_s {self.every_s} must be > 0 seconds")
        if not 0 <= self.during_recovery <= 1:
            raise ConfigError(f"during_recovery {self.during_recovery} is a chance in [0, 1]")
        if not self.slow_duration > 0:
            raise ConfigError(f"slow_duration {self.slow_duration} must be > 0 seconds")


@dataclass(frozen=True)
class Checks:
    """Bounds the invariants use. `detection_bound_s`: the longest pause in committed
    steps; `shutdown_bound_s`: from the last member's finish to the end of the run;
    `min_goodput`: a target ratio to the fault-free run's samples per second."""

    detection_bound_s: float = 10.0
    shutdown_bound_s: float = 45.0
    min_goodput: float | None = None

    def __post_init__(self) -> None:
        if not self.detection_bound_s > 0 or not self.shutdown_bound_s > 0:
            raise ConfigError("detection_bound_s and shutdown_bound_s must be > 0 seconds")
        if self.min_goodput is not None and not 0 < self.min_goodput <= 1:
            raise ConfigError(f"min_goodput {self.min_goodput} must be in (0, 1]")


@dataclass(frozen=True)
class Scenario:
    name: str
    job: Job
    faults: tuple[Fault, ...] = ()
    random: RandomFaults | None = None
    runs: int = 1
    seed: int = 0
    checks: Checks = field(default_factory=Checks)
    description: str = ""
    known_failure: str | None = None  # a finding this scenario demonstrates (it fails)
    source: str = "<scenario>"

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a scenario needs a name")
        if self.runs < 1:
            raise ConfigError(f"runs {self.runs} must be >= 1")
        if not self.faults and self.random is None:
            raise ConfigError("a scenario needs faults, random faults, or both")
        joins = sum(1 for f in self.faults if f.kind is FaultKind.JOIN_NODE)
        workers = (self.job.nodes + joins) * self.job.nproc_per_node
        if workers > self.job.n_micro:
            raise ConfigError(
                f"{workers} workers (nodes + joins) but only {self.job.n_micro} micro-batches"
            )
        for index, fault in enumerate(self.faults):
            _check_in_context(index, fault, self.faults, self.job, self.job.nodes + joins)


def _check_in_context(
    index: int, fault: Fault, faults: tuple[Fault, ...], job: Job, nodes: int
) -> None:
    ref = fault.at.during_recovery_of
    if ref is not None and not 0 <= ref < index:
        raise FaultError(
            index,
            f"fault #{index} ({fault}): during_recovery_of {ref} must name an earlier fault "
            f"(0..{index - 1})",
        )
    if ref is not None and faults[ref].kind is FaultKind.JOIN_NODE:
        raise FaultError(index, f"fault #{index} ({fault}): a join is not a recovery to land in")
    if fault.at.step is not None and fault.at.step >= job.steps:
        raise FaultError(
            index, f"fault #{index} ({fault}): step {fault.at.step} is not before steps {job.steps}"
        )
    if fault.node is not None and fault.node >= nodes:
        raise FaultError(
            index, f"fault #{index} ({fault}): node {fault.node} does not exist (0..{nodes - 1})"
        )
