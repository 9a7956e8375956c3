"""The launcher's record of each node it placed, and the pure replacement decision.

Where it sits: `launcher.RayLauncher` keeps one `NodeSlot` per node it asked Ray for
(n0, n1, ... in order; a replacement gets the next name and the dead node's bundle) and
moves it along the states below as Ray answers; `replacements` decides, from the slots
alone, which bundles get a new actor, and `growth` how many nodes to add when the cluster
has more room than the job uses. A slot never goes back:

    PLACING --where answered--> STARTING --start answered--> RUNNING --agent exited--> ENDED
       \\___________________________\\__________________________\\--actor died--> LOST

LOST: Ray says the actor is gone (`ray.kill`, its process died, its Ray node was removed);
its agent and workers went with it (`keeper`). ENDED: the agent exited with `code`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class SlotState(enum.Enum):
    PLACING = "placing"  # the actor is created; Ray has not placed it yet
    STARTING = "starting"  # placed; its agent is being started
    RUNNING = "running"  # its agent runs
    ENDED = "ended"  # its agent exited (`code`)
    LOST = "lost"  # the actor died, its node's processes with it

    @property
    def live(self) -> bool:
        return self in (SlotState.PLACING, SlotState.STARTING, SlotState.RUNNING)


@dataclass
class NodeSlot:
    name: str  # the job's node id, n<k>
    group: Any  # its placement group (the job's first, or one added to grow)
    bundle: int  # its bundle in that group
    actor: Any  # the Ray actor handle
    state: SlotState = SlotState.PLACING
    pending: Any = None  # the one outstanding Ray call (where, start or poll), if any
    ray_node: str = ""  # the Ray node id it was placed on
    host: str = ""  # that node's address, which the agent publishes
    code: int | None = None  # the agent's exit status (ENDED)
    why: str = ""  # why it was LOST (what Ray said)
    replaced_by: str = field(default="")


@dataclass(frozen=True)
class Replacement:
    bundle: int
    replaces: str  # the lost node
    reason: str


def replacements(
    slots: Sequence[NodeSlot], *, max_nodes: int, replace: bool, job_finished: bool
) -> tuple[list[Replacement], str]:
    """Which lost nodes get a new actor in their bundle now, and why (or why not).

    A lost node is replaced while the job has not finished, replacing is on, and the live
    nodes (placing, starting or running) stay within `max_nodes`. Its bundle is Ray's to
    place again (on a node that keeps one bundle per node): until Ray has room the new
    actor waits in PLACING and the job trains on without it."""
    lost = [s for s in slots if s.state is SlotState.LOST and not s.replaced_by]
    if not lost:
        return [], "no lost node"
    if not replace:
        return [], "replacing is off"
    if job_finished:
        return [], "the job has finished"
    room = max_nodes - sum(1 for s in slots if s.state.live)
    chosen = lost[: max(room, 0)]
    out = [Replacement(s.bundle, s.name, f"{s.name} lost ({s.why})") for s in chosen]
    if len(chosen) < len(lost):
        return out, f"{len(lost) - len(chosen)} lost nodes not replaced: at --max-nodes {max_nodes}"
    return out, f"replacing {', '.join(s.name for s in chosen)}"


def growth(
    slots: Sequence[NodeSlot],
    *,
    free_nodes: int,
    max_nodes: int,
    spread_by_resource: bool,
    job_finished: bool,
) -> tuple[int, str]:
    """How many nodes to add now (each in a placement group of its own), and why.

    `free_nodes`: Ray nodes that could hold a bundle and hold no agent of the job. Only
    with a bundle that reserves a custom resource each node has once
    (`spread_by_resource`) is a group of one bundle sure to land on a node without an
    agent; nothing is added while a node is still being placed (a replacement may be
    about to take the free node)."""
    if job_finished:
        return 0, "the job has finished"
    if not spread_by_resource:
        return 0, "the bundle reserves no per-node resource: growing could double up a node"
    if any(s.state is SlotState.PLACING for s in slots):
        return 0, "a node is still being placed"
    room = max_nodes - sum(1 for s in slots if s.state.live)
    count = max(min(room, free_nodes), 0)
    if count == 0:
        why = f"at --max-nodes {max_nodes}" if room <= 0 else "no free Ray node"
        return 0, why
    return count, f"{free_nodes} free Ray nodes, room for {room} more"
