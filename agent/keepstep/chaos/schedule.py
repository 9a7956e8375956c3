"""The concrete faults of each run of a scenario: listed faults plus seeded random ones.

Where it sits: between `scenario.py` (what the file says) and `runner.py` (what is run).
`expand` is a pure function of the scenario: the same seed gives the same faults, so a
failing run is replayed by running its scenario again (or by its `RunPlan.faults`).

Random faults are drawn so that the job can always go on: a fault that takes a member
out (a kill, a hang, a drain, a partition, a corrupted snapshot whose worker is killed)
leaves at least one *steady* node (alive, not recovering from an earlier worker fault)
and at least `min_nodes` of them; a node is steady again `rejoin_steps` after a fault that
did not remove it for good (by time: 20 s). Joined nodes are never targets: they may still
be starting up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from keepstep.chaos.model import Fault, FaultKind, Job, RandomFaults, Scenario, Trigger
from keepstep.errors import ConfigError

# A node hit by a worker fault is steady again after this long in time-driven schedules
# (its worker restarts and is re-admitted); step-driven schedules never count on it.
_REJOIN_S = 20.0
_ETCD_QUIET_STEPS = 50  # steps without another fault after an etcd kill (its restart is 2 s)
_TAKES_MEMBER = frozenset(
    {
        FaultKind.KILL_WORKER,
        FaultKind.KILL_NODE,
        FaultKind.HANG_NODE,
        FaultKind.DRAIN_NODE,
        FaultKind.CORRUPT_SNAPSHOT,
        FaultKind.PARTITION_NODE,
    }
)


@dataclass(frozen=True)
class RunPlan:
    index: int
    seed: int
    faults: tuple[Fault, ...]

    @property
    def native_specs(self) -> tuple[str, ...]:
        """Faults `keepstep run --fault` injects itself (step-triggered, not referenced
        by a later during-recovery fault: the injector must see when those happen)."""
        return tuple(self.faults[i].spec() for i in self.native_indices)

    @property
    def native_indices(self) -> tuple[int, ...]:
        referenced = {f.at.during_recovery_of for f in self.faults}
        return tuple(i for i, f in enumerate(self.faults) if f.native and i not in referenced)

    @property
    def injected(self) -> tuple[tuple[int, Fault], ...]:
        native = set(self.native_indices)
        return tuple((i, f) for i, f in enumerate(self.faults) if i not in native)


def expand(scenario: Scenario) -> list[RunPlan]:
    plans = []
    for run in range(scenario.runs):
        seed = scenario.seed * 1000 + run
        drawn: tuple[Fault, ...] = ()
        if scenario.random is not None:
            drawn = draw(scenario.random, scenario.job, scenario.faults, random.Random(seed))
        plans.append(RunPlan(run, seed, scenario.faults + drawn))
    return plans


def draw(
    spec: RandomFaults, job: Job, fixed: tuple[Fault, ...], rng: random.Random
) -> tuple[Fault, ...]:
    """`spec.count` faults after the `fixed` ones, keeping the job able to continue."""
    removed = {f.node for f in fixed if f.kind.removes_node}
    steady = {n: -1e9 for n in range(job.nodes) if n not in removed}  # node -> steady since
    joins = sum(1 for f in fixed if f.kind is FaultKind.JOIN_NODE)
    workers = job.nodes * job.nproc_per_node
    out: list[Fault] = []
    fired: list[float] = []  # the step (or time) each drawn fault fires at
    positions = _positions(spec, job, rng)
    last_etcd_kill = -1e18
    for i, when in enumerate(positions):
        ready = [n for n, since in steady.items() if since <= when]
        quiet = (positions[i + 1] if i + 1 < len(positions) else float(job.steps)) - when
        since_etcd = when - last_etcd_kill
        options = [
            k
            for k in spec.kinds
            if _feasible(k, spec, ready, job, when, (quiet, since_etcd), workers)
        ]
        if not options:
            raise ConfigError(
                f"random fault #{i}: no kind of {[k.value for k in spec.kinds]} can be placed "
                f"without stopping the job (steady nodes {sorted(ready)}, min_nodes "
                f"{job.min_nodes}); add nodes, slow-node or join-node, or lower count"
            )
        kind = rng.choice(options)
        node = rng.choice(sorted(ready)) if kind.needs_node else None
        if spec.every_s is not None:
            at = Trigger(time=when)
        elif (
            kind is not FaultKind.JOIN_NODE
            and out
            and out[-1].kind in _TAKES_MEMBER
            and rng.random() < spec.during_recovery
            # It fires at the previous fault's step: its node must be steady by then too.
            and (node is None or steady[node] <= fired[-1])
            and (kind is not FaultKind.KILL_ETCD or fired[-1] - last_etcd_kill >= _ETCD_QUIET_STEPS)
        ):
            at = Trigger(during_recovery_of=len(fixed) + len(out) - 1, delay=0.0)
            when = fired[-1]
        else:
            at = Trigger(step=int(when))
        fault = _make(kind, node, at, spec, rng)
        out.append(fault)
        fired.append(when)
        if kind is FaultKind.JOIN_NODE:
            joins += 1
            workers += job.nproc_per_node
        elif kind is FaultKind.KILL_ETCD:
            last_etcd_kill = when
        elif kind.removes_node and fault.duration is None:
            del steady[node]  # type: ignore[arg-type]
        elif kind in _TAKES_MEMBER:
            assert node is not None
            steady[node] = _steady_again(spec, when)
    return tuple(out)


def _steady_again(spec: RandomFaults, when: float) -> float:
    """When a node whose member a fault took out (not for good) may be hit again."""
    if spec.every_s is not None:
        return when + _REJOIN_S
    return when + spec.rejoin_steps if spec.rejoin_steps is not None else 1e18


def _positions(spec: RandomFaults, job: Job, rng: random.Random) -> list[float]:
    if spec.every_s is not None:
        return [spec.every_s * (i + 1) for i in range(spec.count)]
    last = spec.last_step or job.steps - max(10, job.steps // 10)
    slack = last - spec.first_step - (spec.count - 1) * spec.min_gap
    if slack < 0:
        raise ConfigError(
            f"random: {spec.count} faults at least {spec.min_gap} steps apart do not fit "
            f"between steps {spec.first_step} and {last}"
        )
    offsets = sorted(rng.randint(0, slack) for _ in range(spec.count))
    return [float(spec.first_step + o + i * spec.min_gap) for i, o in enumerate(offsets)]


def _feasible(
    kind: FaultKind,
    spec: RandomFaults,
    ready: list[int],
    job: Job,
    when: float,
    gaps: tuple[float, float],
    workers: int,
) -> bool:
    """Whether `kind` can come at `when`; `gaps`: (until the next fault or the end, since the
    last etcd kill)."""
    by_time = spec.every_s is not None
    quiet, since_etcd = gaps
    if kind is FaultKind.JOIN_NODE:
        # Early enough that the new node is up (it starts its processes first) before the end.
        fits = workers + job.nproc_per_node <= job.n_micro
        return not by_time and fits and when <= job.steps / 5
    if kind is FaultKind.KILL_ETCD:
        if by_time:
            return True
        if job.etcd_members > 1:
            # A member of three: the others keep a quorum, unless a second member goes down
            # before the first is back (its restart is 2 s).
            return since_etcd >= _ETCD_QUIET_STEPS
        # Membership cannot change and the job cannot end while a job's only etcd is down:
        # by step, the next fault and the end must be well after it.
        return quiet >= _ETCD_QUIET_STEPS and job.steps - when >= _ETCD_QUIET_STEPS
    if kind is FaultKind.SLOW_NODE:
        return bool(ready)
    # Takes a member out: a steady node must remain, and min_nodes of them.
    return len(ready) - 1 >= max(1, job.min_nodes)


def _make(
    kind: FaultKind, node: int | None, at: Trigger, spec: RandomFaults, rng: random.Random
) -> Fault:
    if kind is FaultKind.SLOW_NODE:
        return Fault(kind, at, node, duration=spec.slow_duration)
    if kind is FaultKind.PARTITION_NODE:
        return Fault(kind, at, node, duration=spec.partition_duration)
    if kind is FaultKind.HANG_NODE:
        # Drawn only when methods are listed, so older scenarios keep their schedules.
        method = rng.choice(spec.hang_methods) if spec.hang_methods else None
        return Fault(kind, at, node, duration=spec.hang_resume_after, method=method)
    if kind is FaultKind.KILL_ETCD:
        return Fault(kind, at, restart_after=2.0)  # losing a lone etcd for good ends the job
    return Fault(kind, at, node)
