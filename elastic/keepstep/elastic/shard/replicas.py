"""Interleaved replicas: which members keep a copy of each shard, always on other nodes.

Where it sits: the second pure step of sharded state, between ``layout`` (who owns what)
and ``plan`` (what moves after a change). A member's snapshot holds its own shard and the
replicas it keeps, so a node can die and every element still has a live copy. A chunked
layout's copies follow its rankings instead (``copies``); ``place_replicas`` hands it on.

The rule (``Placement.rule`` says which one applied)
    NEIGHBOR      the copies of shard i go to the members at layout positions i+1 .. i+R
                  (cyclic). Used whenever those are on R distinct nodes other than i's, which
                  the interleaved layout gives when nodes run the same worker ids.
                  After a loss the survivor to the right of a lost shard already holds it,
                  which is what takes over leftwards in the new layout.
    ROTATION      otherwise, members in node-major order, copy k of position i at position
                  i + k*m (cyclic), m = the largest node's member count; valid whenever
                  (R+1)*m <= W, since node blocks are at most m long.
    LEAST_LOADED  otherwise (one node holds more than W/(R+1) members): each copy goes to the
                  least-loaded member of a node that this shard does not use yet.
    NONE          replicas=0: no copies, any loss loses state.

What it guarantees
    Every shard's R copies sit on R distinct nodes, none of them its owner's, so losing any
    single node leaves at least R copies of every shard (R >= 1: always recoverable). Under
    NEIGHBOR and ROTATION the copy-k map is a bijection: each member keeps exactly R
    replicas, and the live holders of one lost node's shards are distinct members, so
    restoring them is one shard per sender over disjoint (sender, receiver) pairs. Under
    LEAST_LOADED some member must keep more than one of the big node's shards; each copy
    goes to the least-loaded member allowed, which keeps loads close to even (a greedy,
    not a proven optimum), and ``recovery_senders`` still spreads the senders it can.
"""

from __future__ import annotations

import enum
import heapq
import operator
from collections import Counter, deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import overload

from keepstep.elastic.shard.chunks import ChunkLayout
from keepstep.elastic.shard.copies import ChunkPlacement, place_chunk_replicas
from keepstep.elastic.shard.layout import Layout, node_of
from keepstep.elastic.shard.moves import ShardLost
from keepstep.errors import ConfigError

__all__ = ["Placement", "PlacementRule", "ShardLost", "place_replicas", "recovery_senders"]

_SHOWN = 6  # ranges and members named in an error message before "... and N more"


class PlacementRule(enum.Enum):
    """How :func:`place_replicas` chose the holders (see the module docstring)."""

    NONE = "none"
    NEIGHBOR = "neighbor"
    ROTATION = "rotation"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class Placement:
    """``copies[k][i]``: the member keeping copy k+1 of the shard at layout position i.

    Stored by copy, R tuples of W names, rather than W tuples of R: at 100,000 members
    that is 100,000 fewer objects for the garbage collector. ``holders`` is the other view.
    """

    layout: Layout
    replicas: int
    copies: tuple[tuple[str, ...], ...]
    rule: PlacementRule

    @cached_property
    def holders(self) -> tuple[tuple[str, ...], ...]:
        """``holders[i]``: the members keeping copies 1..R of shard i, copy 1 first."""
        if not self.copies:
            return tuple(() for _ in self.layout.members)
        return tuple(zip(*self.copies, strict=True))

    def holders_of(self, member: str) -> tuple[str, ...]:
        """The members keeping copies of ``member``'s shard, copy 1 first."""
        i = self.layout.index(member)
        return tuple(column[i] for column in self.copies)

    @cached_property
    def _kept(self) -> dict[str, tuple[str, ...]]:
        kept: dict[str, list[str]] = {m: [] for m in self.layout.members}
        for owner, hs in zip(self.layout.members, self.holders, strict=True):
            for h in hs:
                kept[h].append(owner)
        return {m: tuple(v) for m, v in kept.items()}

    def kept_by(self, member: str) -> tuple[str, ...]:
        """The owners whose shards ``member`` keeps a replica of, in layout order."""
        self.layout.index(member)  # a clear error for a stranger
        return self._kept[member]

    def load(self) -> Counter[str]:
        """Replicas kept per member (members keeping none are absent)."""
        return Counter(h for column in self.copies for h in column)

    def holdings(self) -> Iterator[tuple[str, int, int, int]]:
        """``(member, start, stop, copy)`` for every non-empty shard a member holds: its
        own (copy 0) and the replicas it keeps (copy k)."""
        b = self.layout.bounds
        for k, column in enumerate((self.layout.members, *self.copies)):
            for who, start, stop in zip(column, b, b[1:], strict=False):
                if stop > start:
                    yield who, start, stop, k

    def lost(self, live: Collection[str]) -> int:
        """Elements whose owner is not in ``live``."""
        b = self.layout.bounds
        return sum(
            stop - start
            for m, start, stop in zip(self.layout.members, b, b[1:], strict=False)
            if m not in live
        )


def _shift_is_valid(nodes: Sequence[str], replicas: int) -> bool:
    # Positions i, i+1, ..., i+R on pairwise distinct nodes for every i (cyclic): it is
    # enough that no position shares a node with the one d = 1..R places to its right.
    for d in range(1, replicas + 1):
        if any(map(operator.eq, nodes, (*nodes[d:], *nodes[:d]))):
            return False
    return True


def _shifted(order: Sequence[str], steps: Sequence[int]) -> dict[str, tuple[str, ...]]:
    w = len(order)
    return {m: tuple(order[(i + s) % w] for s in steps) for i, m in enumerate(order)}


def _least_loaded(members: Sequence[str], nodes: Sequence[str], replicas: int) -> list[list[str]]:
    # One heap of (load, position) per node and one heap holding each node's best entry,
    # so a pick costs O(log W) plus the few nodes this shard already uses.
    per_node: dict[str, list[tuple[int, int]]] = {}
    for pos, nd in enumerate(nodes):
        per_node.setdefault(nd, []).append((0, pos))  # ascending: already a heap
    top = [(h[0][0], h[0][1], nd) for nd, h in per_node.items()]
    heapq.heapify(top)
    holders: list[list[str]] = [[] for _ in members]
    for _ in range(replicas):  # copy 1 of every shard, then copy 2, ...: even loads
        for p, chosen in enumerate(holders):
            used = {nodes[p]} | {node_of(h) for h in chosen}
            skipped: list[tuple[int, int, str]] = []
            while True:
                entry = heapq.heappop(top)
                if entry[2] not in used:
                    break
                skipped.append(entry)
            heap = per_node[entry[2]]
            load, q = heapq.heappop(heap)
            heapq.heappush(heap, (load + 1, q))
            heapq.heappush(top, (heap[0][0], heap[0][1], entry[2]))
            for e in skipped:
                heapq.heappush(top, e)
            chosen.append(members[q])
    return holders


@overload
def place_replicas(layout: Layout, replicas: int = 1) -> Placement: ...


@overload
def place_replicas(layout: ChunkLayout, replicas: int = 1) -> ChunkPlacement: ...


def place_replicas(layout: Layout | ChunkLayout, replicas: int = 1) -> Placement | ChunkPlacement:
    """Where the ``replicas`` copies of every shard live; a pure function of ``layout``
    (a chunked layout's copies follow its rankings: see ``copies``).

    Raises :class:`ConfigError` when no placement exists: ``replicas`` negative, or not
    below the number of nodes (each copy needs a node of its own besides the owner's).
    """
    if isinstance(layout, ChunkLayout):
        return place_chunk_replicas(layout, replicas)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ConfigError(f"replicas={replicas!r} must be an int >= 0")
    members = layout.members
    if replicas == 0:
        return Placement(layout, 0, (), PlacementRule.NONE)
    nodes = [m.rpartition("/")[0] for m in members]  # the layout checked every name
    distinct = set(nodes)
    if replicas >= len(distinct):
        names = sorted(distinct)
        shown = ", ".join(names[:_SHOWN]) + (" ..." if len(names) > _SHOWN else "")
        raise ConfigError(
            f"replicas={replicas} needs members on at least {replicas + 1} nodes (each copy "
            f"on a node other than the owner's and the other copies'), but the "
            f"{len(members)} members are on {len(distinct)} node(s): {shown}; use "
            f"replicas <= {len(distinct) - 1}"
        )
    if _shift_is_valid(nodes, replicas):
        shifted = tuple((*members[s:], *members[:s]) for s in range(1, replicas + 1))
        return Placement(layout, replicas, shifted, PlacementRule.NEIGHBOR)
    biggest = max(Counter(nodes).values())
    if (replicas + 1) * biggest <= len(members):
        grouped = sorted(members, key=lambda m: (len(node_of(m)), node_of(m), layout.index(m)))
        by_member = _shifted(grouped, [k * biggest for k in range(1, replicas + 1)])
        copies = tuple(tuple(by_member[m][k] for m in members) for k in range(replicas))
        return Placement(layout, replicas, copies, PlacementRule.ROTATION)
    chosen = _least_loaded(members, nodes, replicas)
    copies = tuple(zip(*chosen, strict=True))
    return Placement(layout, replicas, copies, PlacementRule.LEAST_LOADED)


def _match(shards: Sequence[str], options: dict[str, list[str]]) -> dict[str, str]:
    # Maximum bipartite matching shard -> holder (augmenting paths found breadth-first, so
    # no recursion however many shards are lost): holder -> the shard it sends.
    sender_of: dict[str, str] = {}
    for root in shards:
        came: dict[str, str | None] = {root: None}  # shard -> holder it was reached through
        via: dict[str, str] = {}  # holder -> shard that reached it
        queue = deque([root])
        free: str | None = None
        while queue and free is None:
            s = queue.popleft()
            for h in options[s]:
                if h in via:
                    continue
                via[h] = s
                if h not in sender_of:
                    free = h
                    break
                came[sender_of[h]] = h
                queue.append(sender_of[h])
        holder = free
        while holder is not None:  # flip the path: every shard on it takes the next holder
            s = via[holder]
            sender_of[holder] = s
            holder = came[s]
    return sender_of


def recovery_senders(placement: Placement, lost: Collection[str]) -> dict[str, str]:
    """For each lost member with a non-empty shard, the live holder that sends its copy.

    Senders are distinct members whenever the holders allow it (a maximum matching); a
    shard left over goes to its least-used live holder. Raises :class:`ShardLost` when a
    lost shard has no live holder at all.
    """
    layout = placement.layout
    gone = set(lost)
    strangers = sorted(gone - set(layout.members))
    if strangers:
        raise ConfigError(f"lost={strangers} are not members of this layout")
    shards = [m for m in layout.members if m in gone and layout.shard(m).size > 0]
    options = {m: [h for h in placement.holders_of(m) if h not in gone] for m in shards}
    dead = [m for m in shards if not options[m]]
    if dead:
        ranges = [layout.shard(m) for m in dead]
        raise ShardLost(ranges, [x for m in dead for x in (m, *placement.holders_of(m))])
    sender_of = _match(shards, options)
    out = {shard: h for h, shard in sender_of.items()}
    used = Counter(out.values())
    for m in shards:
        if m not in out:
            h = min(options[m], key=lambda x: used[x])
            out[m] = h
            used[h] += 1
    return {m: out[m] for m in shards}
