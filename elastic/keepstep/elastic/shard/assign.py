"""Who owns each chunk: the bounded stable assignment of chunks to nodes, and its updates.

Where it sits: between ``ring`` (how each chunk ranks the nodes) and ``chunks`` (the
layout object). :func:`assign` builds an assignment from nothing; :func:`without` derives
the assignment of a smaller member set from a larger one and ends exactly where
:func:`assign` would (``tests/elastic/test_shard_chunks.py`` checks it), touching only the
chunks that change: after a single-node loss at 100,000 members about a thousand chunks
out of six million, which keeps the recovery plan's cost independent of the world size.

The assignment
    Deferred acceptance with one weight on both sides: a chunk asks the nodes in its
    ranking in turn; a node under its cap keeps what it is offered; a full node keeps the
    nearest chunks (by the distance the chunk ranked it by) and turns the farthest away,
    which asks on. With one weight on both sides the stable assignment is unique: neither
    the order of asking nor the state one resumes from changes the end, if the end is
    stable. Each chunk's replica node (``nexts``) is then assigned the same way over the
    nodes other than its owner's, under the same caps (``replica_assign``): mostly the
    next node after the owner in its ranking, which is where the chunk goes if the
    owner's node is lost and that node has room.

What ``without`` does
    1. Chunks of lost nodes, chunks of a shrunk node whose distance to it grew (fewer
       points), and chunks a shrunk node sheds to meet its smaller cap are set free.
    2. Nodes whose cap grew take back, best first, chunks they had turned away (every
       refusal is remembered in ``rejected``) that still prefer them; each leaves a vacancy
       at its old owner, refilled the same way. No node with room is then preferred by a
       chunk it does not hold.
    3. The free chunks ask down their rankings, as in :func:`assign`; a full node ranked
       before a chunk's last owner that has neither taken nor given a chunk since turned
       it away before and would again, so the chunk passes it by.
    4. The replicas are updated the same way (``ReplicaBuilder.update``).
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, insort
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice

from keepstep.elastic.shard.accept import TAKEN, TURNED_AWAY, Acceptance
from keepstep.elastic.shard.blocks import Blocks
from keepstep.elastic.shard.replica_assign import ReplicaBuilder, Tops, place_replicas
from keepstep.elastic.shard.ring import Caps, Ring

__all__ = ["Assignment", "assign", "without"]


@dataclass
class Assignment:
    """The owner node of every chunk and the state updating it needs. Not changed once
    built (:func:`without` forks it); node numbers are the ring's."""

    ring: Ring
    count: int
    units: int  # per chunk (the caps keep members' slices balanced)
    slack: int  # permille
    present: bytearray  # per ring member
    groups: list[int]  # present members per node
    live: int  # nodes with a present member
    caps: Caps
    loads: list[int]
    owners: Blocks  # per chunk: its node
    dists: Blocks  # per chunk: its distance to its owner
    nexts: Blocks  # per chunk: the node keeping its replica (-1: no other node)
    rdists: Blocks  # per chunk: its distance to that node
    rloads: list[int]  # per node: replicas kept under the cap (spilled ones not counted)
    by_node: dict[int, array[int]] = field(default_factory=dict)  # node -> chunks, sorted
    by_next: dict[int, array[int]] = field(default_factory=dict)  # node -> replicas, sorted
    rejected: dict[int, list[int]] = field(default_factory=dict)  # node -> heap of keys
    rrejected: dict[int, list[int]] = field(default_factory=dict)  # the same, for replicas
    spilled: set[int] = field(default_factory=set)  # replicas kept above a node's cap
    parent: Assignment | None = field(default=None, repr=False)
    moved: frozenset[int] = frozenset()  # chunks whose owner or next differs from parent's
    shrunk: frozenset[int] = frozenset()  # nodes that lost members since the parent


class _Builder:
    """Deferred acceptance resumed over a forked assignment (see :func:`without`).

    ``by_node`` is kept up to date as chunks move; its arrays and the ``rejected`` heaps
    are shared with the old assignment, so each is copied before its first write. A full
    node's heap of held keys is gathered on first need and its stale entries (chunks that
    left) dropped when they surface.
    """

    def __init__(self, a: Assignment) -> None:
        self.a = a
        self.shift = max(a.count - 1, 1).bit_length()
        self.low = (1 << self.shift) - 1
        self.heaps: dict[int, list[int]] = {}  # node -> max-heap (negated keys) it holds
        self.touched: set[int] = set()
        self.own: set[tuple[int, int]] = set()  # (index number, node) copied for writing
        self.unsteady: set[int] = set()  # nodes that took or gave back chunks, or shrank

    def key(self, dist: int, c: int) -> int:
        return (dist << self.shift) | c

    def _index(self, n: int) -> array[int]:
        index = self.a.by_node
        if (0, n) not in self.own:
            index[n] = array("i", index.get(n, ()))
            self.own.add((0, n))
        return index[n]

    def _turned(self, n: int) -> list[int]:
        if (2, n) not in self.own:
            self.a.rejected[n] = [*self.a.rejected.get(n, ())]
            self.own.add((2, n))
        return self.a.rejected[n]

    def heap(self, n: int) -> list[int]:
        a = self.a
        heap = self.heaps.get(n)
        if heap is None:
            mine = a.by_node.get(n, ())
            shift = self.shift
            heap = [-((d << shift) | c) for d, c in zip(a.dists.gather(mine), mine, strict=True)]
            heapq.heapify(heap)
            self.heaps[n] = heap
        while heap:  # drop entries of chunks that have left since
            c = -heap[0] & self.low
            if a.owners[c] == n and a.dists[c] == -heap[0] >> self.shift:
                break
            heapq.heappop(heap)
        return heap

    def take(self, c: int, n: int, dist: int) -> None:
        a = self.a
        a.owners[c], a.dists[c] = n, dist
        a.loads[n] += 1
        self.unsteady.add(n)
        insort(self._index(n), c)
        if n in self.heaps:
            heapq.heappush(self.heaps[n], -self.key(dist, c))
        self.touched.add(c)

    def release(self, c: int) -> None:
        """Chunk c leaves its owner (its heap entry goes stale)."""
        a = self.a
        n = a.owners[c]
        a.loads[n] -= 1
        self.unsteady.add(n)
        mine = self._index(n)
        del mine[bisect_left(mine, c)]
        a.owners[c] = -1
        self.touched.add(c)

    def turn_away(self, n: int, key: int) -> None:
        heapq.heappush(self._turned(n), key)

    def ask(self, c: int) -> None:
        """Chunk c (free) asks down its ranking; whoever it displaces asks on.

        A node ranked before c's last owner turned c away once. If it is full and nothing
        about it has changed since (``steady``: it has taken no chunk and given none back,
        and it has all its members), it would again: c passes it by without asking.
        """
        a = self.a
        floor = -1
        hint = a.dists[c]  # the distance to its last owner
        while True:
            ranking = a.ring.ranking(c, a.present, a.live)
            for n, dist in ranking:
                if dist <= floor:
                    continue  # ranked before the node that turned c away
                if dist < hint and n not in self.unsteady and a.loads[n] >= a.caps[n]:
                    continue
                if a.loads[n] < a.caps[n]:
                    self.take(c, n, dist)
                    return
                key = self.key(dist, c)
                heap = self.heap(n)
                if key < -heap[0]:
                    out = -heap[0]
                    bumped = out & self.low
                    self.release(bumped)
                    self.take(c, n, dist)
                    self.turn_away(n, out)
                    c, floor = bumped, out >> self.shift
                    hint = -1
                    break
                self.turn_away(n, key)
            else:
                raise AssertionError(f"chunk {c} found no node with room")  # caps sum >= count

    def refill(self, nodes: Iterable[int]) -> None:
        """Nodes with room take back, best first, chunks they turned away that still
        prefer them; each leaves a vacancy at its old owner, refilled in turn."""
        a = self.a
        todo = [n for n in nodes if a.rejected.get(n) and a.loads[n] < a.caps[n]]
        while todo:
            n = todo.pop()
            self.unsteady.add(n)
            turned = self._turned(n)
            while turned and a.loads[n] < a.caps[n]:
                key = heapq.heappop(turned)
                c, dist = key & self.low, key >> self.shift
                o = a.owners[c]
                if o < 0 or o == n or a.dists[c] <= dist:
                    continue  # free (it asks later), or it no longer prefers n
                self.release(c)
                self.take(c, n, dist)
                todo.append(o)


def assign(ring: Ring, count: int, units: int, slack: int) -> Assignment:
    """The assignment of ``count`` chunks of ``units`` units over all of ``ring``'s
    members (``slack`` in permille of each node's even share). Deferred acceptance written
    out flat: this is the one pass over every chunk, the layout's build time."""
    present = bytearray(b"\x01") * len(ring.members)
    groups = [0] * len(ring.nodes)
    for n in ring.member_node:
        groups[n] += 1
    node_caps = Caps(count, units, groups, ring.dithers, slack, len(ring.members))
    cap = [node_caps[n] for n in range(len(groups))]
    owners = array("i", [-1]) * count
    dists = array("Q", [0]) * count
    loads = [0] * len(groups)
    shift = max(count - 1, 1).bit_length()
    low = (1 << shift) - 1
    rejected: dict[int, list[int]] = {}
    offers = Acceptance(cap, loads, rejected)
    # Each chunk's first two nodes: where its replica goes unless that node is full.
    zeros = array("Q", [0]) * count
    tops = Tops(array("i", [-1]) * count, zeros, array("i", [-1]) * count, array("Q", zeros))
    ranking = ring.ranking
    for first in range(count):
        c, floor = first, -1
        while c >= 0:
            walk: Iterator[tuple[int, int]] = ranking(c, present, len(groups))
            if c == first:  # its first walk
                head = list(islice(walk, 2))
                tops.first[c], tops.first_dist[c] = head[0]
                if len(head) > 1:
                    tops.second[c], tops.second_dist[c] = head[1]
                walk = chain(head, walk)
            for n, dist in walk:
                if dist <= floor:
                    continue
                out = offers.offer(n, (dist << shift) | c)
                if out == TURNED_AWAY:
                    continue
                owners[c], dists[c] = n, dist
                c, floor = (-1, floor) if out == TAKEN else (out & low, out >> shift)
                break
            else:
                raise AssertionError(f"chunk {c} found no node with room")  # caps sum >= count
    a = Assignment(
        ring,
        count,
        units,
        slack,
        present,
        groups,
        len(groups),
        node_caps,
        loads,
        Blocks("i", owners),
        Blocks("Q", dists),
        Blocks("i", array("i", [-1]) * count),
        Blocks("Q", array("Q", [0]) * count),
        [0] * len(groups),
        rejected=rejected,
    )
    for c, n in enumerate(owners):
        a.by_node.setdefault(n, array("i")).append(c)
    place_replicas(a, tops)
    return a


def without(old: Assignment, removed: Collection[str]) -> Assignment:
    """The assignment without the ``removed`` members (present in ``old``), derived from
    ``old``: equal to :func:`assign` over the rest, at the cost of what moves."""
    ring = old.ring
    present = bytearray(old.present)
    groups = [*old.groups]
    for m in removed:
        i = ring.member_id[m]
        present[i] = 0
        groups[ring.member_node[i]] -= 1
    world = sum(groups)
    a = Assignment(
        ring,
        old.count,
        old.units,
        old.slack,
        present,
        groups,
        sum(1 for g in groups if g),
        Caps(old.count, old.units, groups, ring.dithers, old.slack, world),
        [*old.loads],
        old.owners.fork(),
        old.dists.fork(),
        old.nexts.fork(),
        old.rdists.fork(),
        [*old.rloads],
        by_node=dict(old.by_node),
        by_next=dict(old.by_next),
        rejected=dict(old.rejected),
        rrejected=dict(old.rrejected),
        spilled=set(old.spilled),
        parent=old,
    )
    b = _Builder(a)
    free: list[int] = []
    shrunk = sorted({ring.member_node[ring.member_id[m]] for m in removed})
    b.unsteady.update(shrunk)
    for n in shrunk:
        g = groups[n]
        if g == 0:  # the node is gone: its chunks are free
            for c in a.by_node.pop(n, ()):
                a.owners[c] = -1
                free.append(c)
            a.loads[n] = 0
            a.rejected.pop(n, None)
            continue
        # Fewer members, fewer points: some chunks are now farther from the node.
        for c in [*a.by_node.get(n, ())]:
            if ring.distance(c, n, present) != a.dists[c]:
                b.release(c)
                free.append(c)
        turned = [k & b.low for k in a.rejected.get(n, ())]
        rekeyed = [b.key(ring.distance(c, n, present), c) for c in turned]
        heapq.heapify(rekeyed)
        a.rejected[n] = rekeyed
        b.own.add((2, n))
        while a.loads[n] > a.caps[n]:  # its cap shrank: it sheds its farthest chunks
            key = -b.heap(n)[0]
            b.release(key & b.low)
            b.turn_away(n, key)
            free.append(key & b.low)
    b.touched.update(free)
    b.refill(list(a.rejected))
    for c in free:
        b.ask(c)
    r = ReplicaBuilder(a)
    r.update(old, shrunk, b.touched)
    a.shrunk = frozenset(shrunk)
    a.moved = frozenset(
        c
        for c in b.touched | r.touched
        if a.owners[c] != old.owners[c] or a.nexts[c] != old.nexts[c]
    )
    return a
