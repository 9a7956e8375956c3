"""The seeded fault schedule every system gets: the same faults at the same committed steps.

One schedule per invocation, a pure function of (seed, steps, nodes, warm-up):

    steady window -> kill-node:A -> (three nodes) -> kill-worker:B -> join-node -> tail

The kill-node comes first, so the stretch after it measures throughput after losing 1 of
4 nodes; then a worker crash on a surviving node (the process dies, its node stays and
its supervisor restarts it); then the lost node's replacement joins, last, with the
longest stretch after it, since starting a new node takes seconds whatever the system.
Node 0 is never a victim: it hosts torchrun's c10d rendezvous store, and losing that ends
a torchrun job outright, which would measure nothing about recovery. Faults fire when the
job has committed the given step, so a slow restart never shortens the windows after it.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class FaultKind(enum.Enum):
    KILL_NODE = "kill-node"  # every process of the node, for good (until a join)
    JOIN_NODE = "join-node"  # a fresh node (for TorchFT: a replacement replica group)
    KILL_WORKER = "kill-worker"  # the training process only; its node restarts it

    @property
    def is_failure(self) -> bool:
        return self is not FaultKind.JOIN_NODE


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    node: int | None  # None for a join
    step: int

    def __post_init__(self) -> None:
        if (self.node is None) != (self.kind is FaultKind.JOIN_NODE):
            raise ValueError(f"{self.kind.value}: node={self.node} (only join-node has none)")
        if self.step < 1:
            raise ValueError(f"{self.kind.value}: step={self.step} must be >= 1")

    def spec(self) -> str:
        """The `keepstep run --fault` form, e.g. kill-node:2@step=12."""
        target = "" if self.node is None else f":{self.node}"
        return f"{self.kind.value}{target}@step={self.step}"

    def as_json(self) -> dict[str, object]:
        return {"kind": self.kind.value, "node": self.node, "step": self.step}


def make_schedule(seed: int, steps: int, nodes: int, warmup: int) -> tuple[Fault, ...]:
    """kill-node, kill-worker, join-node at seeded steps and victims (never node 0)."""
    if nodes < 3:
        raise ValueError(f"nodes={nodes}: the schedule needs >= 3 (node 0 and two victims)")
    if steps < 4 * warmup + 12:
        raise ValueError(f"steps={steps} must be >= 4 x warmup ({warmup}) + 12")
    rng = random.Random(seed)
    unit = steps / 6
    jitter = max(1, int(unit) // 4)

    def around(x: float) -> int:
        return round(x) + rng.randint(-jitter, jitter)

    # Steady window, three-node stretch and the tail keep >= warmup + 2 steps each.
    kill_node = max(around(1.5 * unit), 2 * warmup + 2)
    kill_worker = max(around(2.5 * unit), kill_node + warmup + 3)
    join = min(max(around(3.5 * unit), kill_worker + warmup + 2), steps - warmup - 2)
    victim = rng.randint(1, nodes - 1)
    worker_victim = rng.choice([n for n in range(1, nodes) if n != victim])
    return (
        Fault(FaultKind.KILL_NODE, victim, kill_node),
        Fault(FaultKind.KILL_WORKER, worker_victim, kill_worker),
        Fault(FaultKind.JOIN_NODE, None, join),
    )
