"""Where each chunk's replica lives: a second bounded stable assignment, over the nodes
other than the chunk's owner's.

Where it sits: beside ``assign`` (who owns each chunk), which calls it once the owners are
settled: :func:`place_replicas` fills a fresh assignment's replica columns, and
:class:`ReplicaBuilder` updates a derived one's at the cost of what moves, ending exactly
where :func:`place_replicas` would (``tests/elastic/test_shard_chunks.py`` checks it).

The rule
    Deferred acceptance again, with the same weight on both sides and the same caps as
    the owners (``ring.Caps``): a chunk asks the nodes of its ranking in turn, its owner's
    node passed by; a node under its replica cap keeps what it is offered; a full node
    keeps the nearest and turns the farthest away, which asks on. Most chunks keep their
    replica on the first node after their owner, which is where the chunk goes when its
    owner's node is lost (the new owner then has the data in place); the cap moves the
    rest on, so that no node keeps more than about ``1 + slack`` of its share of
    replicas, as no node owns more. (A chunk the owners' cap sent down its ranking asks
    its first node, the one that turned it away as owner, first.) Uncapped, the first
    node after the owner kept up to 1.29x its share at 8-16 nodes, and a member's
    optimizer memory (its own chunks and the replicas it steps) was the sum of both
    noises: ZeRO-1 at 4 members took 1.116x of 2/W (``bench/shard_memory.py``), 1.07x now.
    The cost: when a node's cap grows as the world shrinks, it takes back replicas it had
    turned away, moves the loss did not need. Where the caps seldom bind (equal nodes)
    that is nothing (within 10% of the lost elements with equal nodes, or one a member
    short); where they bind on most nodes (uneven nodes, one with a quarter to a third of
    the members, which cannot keep its own chunks' replicas) up to ~60% of them
    (``tests/elastic/test_shard_chunks.py`` names the search that measured it).
Spills
    A chunk every other node has turned away (the owner's node holds more than all the
    others' caps: two nodes, or one node with most members; or few chunks, whose caps
    leave little room) keeps its replica on the first node other than its owner's anyway,
    above that node's cap. Spilled replicas do not
    count against the cap, so they never displace another chunk, and the set of chunks
    that spill is the same whatever the order of asking. They are remembered in
    ``spilled``; when a node gains room it takes them back like any chunk it turned away.

What an update does (:meth:`ReplicaBuilder.update`, after the owners' update)
    1. Chunks whose replica node left, or a shrunk node that is farther from them now, or
       whose owner changed (the node after the new owner differs; the old owner may be
       eligible again), and chunks a shrunk node sheds to meet its cap, are set free.
    2. Nodes with room take back, best first, chunks they turned away that still prefer
       them; each vacancy this leaves is refilled the same way.
    3. The free chunks ask down their rankings.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keepstep.elastic.shard.accept import TAKEN, TURNED_AWAY, Acceptance

if TYPE_CHECKING:
    from keepstep.elastic.shard.assign import Assignment

__all__ = ["ReplicaBuilder", "Tops", "place_replicas"]


@dataclass(frozen=True)
class Tops:
    """Per chunk, the first two nodes of its ranking and their distances (-1: none), as
    the owners' pass saw them. A chunk's replica asks first whichever of the two is not
    its owner, and most are taken there, with no second walk down the ranking."""

    first: array[int]
    first_dist: array[int]
    second: array[int]
    second_dist: array[int]


def place_replicas(a: Assignment, tops: Tops) -> None:
    """Fill ``a``'s replica columns (``nexts``, ``rdists``, ``rloads``, ``rrejected``,
    ``spilled``, ``by_next``) from its owners: the one pass over every chunk, written
    out flat like ``assign``'s."""
    ring, present, live, caps = a.ring, a.present, a.live, a.caps
    cap = [caps[n] for n in range(len(a.groups))]
    owners, nexts, rdists, loads = a.owners, a.nexts, a.rdists, a.rloads
    shift = max(a.count - 1, 1).bit_length()
    low = (1 << shift) - 1
    offers = Acceptance(cap, loads, a.rrejected)
    ranking = ring.ranking
    for first in range(a.count):
        c, floor = first, -1
        n = tops.first[c]
        dist = tops.first_dist[c]
        if n == owners[c]:
            n, dist = tops.second[c], tops.second_dist[c]
        if n >= 0 and loads[n] < cap[n]:  # taken by its first choice, which has room
            offers.offer(n, (dist << shift) | c)
            nexts[c], rdists[c] = n, dist
            continue
        while c >= 0:
            owner, spare, spare_dist = owners[c], -1, 0
            for n, dist in ranking(c, present, live):
                if n == owner:
                    continue
                if spare < 0:
                    spare, spare_dist = n, dist
                if dist <= floor:
                    continue
                out = offers.offer(n, (dist << shift) | c)
                if out == TURNED_AWAY:
                    continue
                nexts[c], rdists[c] = n, dist
                c, floor = (-1, floor) if out == TAKEN else (out & low, out >> shift)
                break
            else:  # every other node turned it away (or there is none): it spills
                nexts[c], rdists[c] = spare, spare_dist
                if spare >= 0:
                    a.spilled.add(c)
                c = -1
    for c, n in enumerate(nexts):
        if n >= 0:
            a.by_next.setdefault(n, array("i")).append(c)


class ReplicaBuilder:
    """Deferred acceptance for replicas resumed over a forked assignment.

    Its ``by_next`` arrays and ``rrejected`` heaps are shared with the old assignment, so
    each is copied before its first write; ``spilled`` is the fork's own set.
    """

    def __init__(self, a: Assignment) -> None:
        self.a = a
        self.shift = max(a.count - 1, 1).bit_length()
        self.low = (1 << self.shift) - 1
        self.heaps: dict[int, list[int]] = {}  # node -> max-heap (negated keys) it holds
        self.touched: set[int] = set()
        self.own: set[tuple[int, int]] = set()  # (index number, node) copied for writing

    def key(self, dist: int, c: int) -> int:
        return (dist << self.shift) | c

    def _held(self, n: int) -> array[int]:
        if (0, n) not in self.own:
            self.a.by_next[n] = array("i", self.a.by_next.get(n, ()))
            self.own.add((0, n))
        return self.a.by_next[n]

    def _turned(self, n: int) -> list[int]:
        if (1, n) not in self.own:
            self.a.rrejected[n] = [*self.a.rrejected.get(n, ())]
            self.own.add((1, n))
        return self.a.rrejected[n]

    def heap(self, n: int) -> list[int]:
        """Node n's held (not spilled) replicas, farthest on top, stale entries dropped."""
        a = self.a
        heap = self.heaps.get(n)
        if heap is None:
            mine = [c for c in a.by_next.get(n, ()) if c not in a.spilled]
            shift = self.shift
            heap = [-((d << shift) | c) for d, c in zip(a.rdists.gather(mine), mine, strict=True)]
            heapq.heapify(heap)
            self.heaps[n] = heap
        while heap:
            c = -heap[0] & self.low
            if a.nexts[c] == n and a.rdists[c] == -heap[0] >> self.shift and c not in a.spilled:
                break
            heapq.heappop(heap)
        return heap

    def take(self, c: int, n: int, dist: int, spill: bool = False) -> None:
        a = self.a
        a.nexts[c], a.rdists[c] = n, dist
        insort(self._held(n), c)
        if spill:
            a.spilled.add(c)
        else:
            a.rloads[n] += 1
            if n in self.heaps:
                heapq.heappush(self.heaps[n], -self.key(dist, c))
        self.touched.add(c)

    def release(self, c: int) -> None:
        """Chunk c's replica leaves its node (its heap entry goes stale)."""
        a = self.a
        n = a.nexts[c]
        mine = self._held(n)
        del mine[bisect_left(mine, c)]
        if c in a.spilled:
            a.spilled.discard(c)
        else:
            a.rloads[n] -= 1
        a.nexts[c] = -1
        self.touched.add(c)

    def ask(self, c: int) -> None:
        """Chunk c (free) asks down its ranking; whoever it displaces asks on."""
        a = self.a
        floor = -1
        while True:
            owner, spare, spare_dist = a.owners[c], -1, 0
            for n, dist in a.ring.ranking(c, a.present, a.live):
                if n == owner:
                    continue
                if spare < 0:
                    spare, spare_dist = n, dist
                if dist <= floor:
                    continue
                if a.rloads[n] < a.caps[n]:
                    self.take(c, n, dist)
                    return
                key = self.key(dist, c)
                heap = self.heap(n)
                if heap and key < -heap[0]:
                    out = -heap[0]
                    bumped = out & self.low
                    self.release(bumped)
                    self.take(c, n, dist)
                    heapq.heappush(self._turned(n), out)
                    c, floor = bumped, out >> self.shift
                    break
                heapq.heappush(self._turned(n), key)
            else:
                if spare >= 0:
                    self.take(c, spare, spare_dist, spill=True)
                return

    def refill(self, nodes: Iterable[int]) -> None:
        """Nodes with room take back, best first, chunks they turned away that still
        prefer them; each leaves a vacancy at its old node, refilled in turn."""
        a = self.a
        todo = [n for n in nodes if a.rrejected.get(n) and a.rloads[n] < a.caps[n]]
        while todo:
            n = todo.pop()
            turned = self._turned(n)
            while turned and a.rloads[n] < a.caps[n]:
                key = heapq.heappop(turned)
                c, dist = key & self.low, key >> self.shift
                o, spilled = a.nexts[c], c in a.spilled
                if o < 0 or a.owners[c] == n:
                    continue  # free (it asks later), or n is its owner's node now
                if not spilled and (o == n or a.rdists[c] <= dist):
                    continue  # it is here, or it no longer prefers n
                self.release(c)
                self.take(c, n, dist)
                if not spilled:
                    todo.append(o)

    def update(self, old: Assignment, shrunk: Iterable[int], moved_owner: Iterable[int]) -> None:
        """Resume from ``old``'s replicas after the owners' update (module docstring)."""
        a, ring = self.a, self.a.ring
        free: list[int] = []
        for n in shrunk:
            if a.groups[n] == 0:  # the node is gone: the replicas it kept are free
                for c in a.by_next.pop(n, ()):
                    a.nexts[c] = -1
                    a.spilled.discard(c)
                    free.append(c)
                    self.touched.add(c)
                a.rloads[n] = 0
                a.rrejected.pop(n, None)
                continue
            for c in [*a.by_next.get(n, ())]:  # fewer points: farther from some chunks
                if ring.distance(c, n, a.present) != a.rdists[c]:
                    self.release(c)
                    free.append(c)
            turned = [k & self.low for k in a.rrejected.get(n, ())]
            rekeyed = [self.key(ring.distance(c, n, a.present), c) for c in turned]
            heapq.heapify(rekeyed)
            a.rrejected[n] = rekeyed
            self.own.add((1, n))
            while a.rloads[n] > a.caps[n]:  # its cap shrank: it sheds its farthest
                key = -self.heap(n)[0]
                self.release(key & self.low)
                heapq.heappush(self._turned(n), key)
                free.append(key & self.low)
        for c in moved_owner:
            if a.owners[c] != old.owners[c] and a.nexts[c] >= 0:
                self.release(c)
                free.append(c)
        self.refill(list(a.rrejected))
        for c in free:
            if a.nexts[c] < 0:
                self.ask(c)
