"""The ranking behind the chunked layout: members' points on a circle, probed per chunk.

Where it sits: under ``assign`` (who owns each chunk) and ``chunks`` (the layout). It
answers one question, fast and the same in every process: in what order does chunk c
rank the nodes? The order is a fixed function of the chunk and of each member's name, so
adding or removing a member changes no other node's place in any chunk's ranking. That
is what makes the assignment above it move only what it must.

The rule
    Points. Every member puts ``POINTS`` points on a circle of ``2**64`` positions, read
    from a keyed BLAKE2b of its name (stable across processes and Python versions, unlike
    the salted ``hash()``). A node's points are its members' points.
    Probes. Chunk c of ``count`` probes the circle at ``len(PROBES)`` positions, Weyl
    sequences ``offset_j + c * step_j`` (mod ``2**64``) whose steps are the R_8
    low-discrepancy constants, so neighbouring chunks probe far apart.
    Ranking. A node's distance from chunk c is the least clockwise distance from one of
    c's probes to one of the node's present points; c ranks nodes by that distance (ties,
    which need two equal 64-bit positions, by probe number, then by member name). The
    points are bucketed by their top bits, so a probe finds the point after it with one
    lookup and a bisection over a handful.

Why probes, and not scores over every node
    Rendezvous hashing scores every node per chunk: at 100,000 members on 12,500 nodes and
    6.4 million chunks, 8 * 10**10 steps. A ring finds a chunk's first node with one
    bisection, but one probe gives each node the arcs in front of its points, whose
    lengths vary by ``1/sqrt(points)`` (18% for one member's 32 points). With 8 probes a
    node wins a chunk only when a probe lands close in front of one of its points, which
    evens the nodes' shares out to about the sampling noise of the chunk count itself.
"""

from __future__ import annotations

import heapq
import struct
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from hashlib import blake2b
from itertools import accumulate, repeat
from operator import rshift

from keepstep.elastic.shard.layout import node_of

__all__ = ["POINTS", "PROBES", "Caps", "Ring", "natural"]

POINTS = 32  # points per member: a node of g members has 32 * g
_KEY = b"keepstep.elastic.shard.ring"
_MASK = (1 << 64) - 1
# (step, offset) of each probe: steps from the R_8 sequence (odd), offsets from BLAKE2b.
PROBES = (
    (0xEBEDEED9D803C001, 0xB8A13A44290CBBAB),
    (0xD96EB1A810CAA001, 0x29C0816674610764),
    (0xC862B36DAF78F801, 0x9A098B28D571402A),
    (0xB8ACD90C142FC801, 0x940BA5027D8E75BC),
    (0xAA324F90DED85001, 0xD5830288CA919ECC),
    (0x9CDA5E693FE9F001, 0x5F4F85D9E836DE40),
    (0x908E3D2C82565801, 0xB644F77A9EB410E1),
    (0x8538ECB5BD454801, 0x6E95EB28E618B7BA),
)


def natural(name: str) -> tuple[int, str]:
    """Sort key that puts "n2" before "n10"."""
    return len(name), name


def _digest(data: bytes, block: int) -> bytes:
    return blake2b(data, digest_size=64, key=_KEY, salt=block.to_bytes(16, "little")).digest()


def _member_points(member: str) -> tuple[int, ...]:
    data = member.encode()
    out: tuple[int, ...] = ()
    for block in range(-(-POINTS // 8)):
        out += struct.unpack("<8Q", _digest(data, block))
    return out[:POINTS]


def dither(node: str) -> int:
    """A fixed number in [0, 2**16) per node name (see :class:`Caps`)."""
    return int.from_bytes(_digest(b"node:" + node.encode(), 0)[:2], "little")


class Ring:
    """Every member's points, sorted round the circle; nodes and members by number.

    Numbers follow sorted names (members by plain string order, nodes naturally), so two
    rings over different member sets order any two shared names alike. Built once per
    member set; layouts derived from it by removing members keep it and skip their points.
    """

    def __init__(self, members: Iterable[str]) -> None:
        self.members = tuple(sorted(members))
        self.nodes = tuple(sorted({node_of(m) for m in self.members}, key=natural))
        node_id = {n: i for i, n in enumerate(self.nodes)}
        self.member_id = {m: i for i, m in enumerate(self.members)}
        self.member_node = array("i", [node_id[node_of(m)] for m in self.members])
        self.node_id = node_id
        # One int per point, position above and member number below: ints sort fast, and
        # the number (sorted names) breaks a tie of positions the same way everywhere.
        shift = max(len(self.members) - 1, 1).bit_length()
        keyed = [(p << shift) | i for i, m in enumerate(self.members) for p in _member_points(m)]
        keyed.sort()
        low = (1 << shift) - 1
        self.pos = array("Q", [k >> shift for k in keyed])
        self.owner = array("i", [k & low for k in keyed])  # member number of each point
        self.node = array("i", [self.member_node[i] for i in self.owner])
        self.dithers = [dither(n) for n in self.nodes]
        self._index_points()

    def _index_points(self) -> None:
        # Points are uniform on the circle: bucket them by their top bits (about four per
        # bucket), so finding a probe's successor is a lookup and a tiny bisection.
        self.bits = max(len(self.pos) // 4, 1).bit_length()
        drop = 64 - self.bits
        counts = Counter(map(rshift, self.pos, repeat(drop)))
        self.first = array("i", accumulate((counts[b] for b in range(1 << self.bits)), initial=0))

    def ranking(self, c: int, present: bytearray, nodes: int = 0) -> Iterator[tuple[int, int]]:
        """``(node, distance)`` in chunk c's ranking: every node with a member marked in
        ``present`` (by member number) once, nearest first. ``nodes``: how many nodes have
        one (0: unknown), so the walk ends when all are seen, not after the whole circle."""
        pos, owner, node, first = self.pos, self.owner, self.node, self.first
        size, drop = len(pos), 64 - self.bits
        heads = []  # (distance, probe, point, probe position): a heap once sorted
        j = 0
        for step, offset in PROBES:
            q = (offset + c * step) & _MASK
            b = q >> drop
            k = bisect_left(pos, q, first[b], first[b + 1])
            if k == size:
                k = 0
            heads.append(((pos[k] - q) & _MASK, j, k, q))
            j += 1
        heads.sort()
        seen: set[int] = set()
        replace = heapq.heapreplace
        for _ in range(j * size):  # each probe walks the circle at most once
            dist, j, k, q = heads[0]
            n = node[k]
            k += 1
            if k == size:
                k = 0
            replace(heads, ((pos[k] - q) & _MASK, j, k, q))
            if n in seen or not present[owner[k - 1]]:
                continue
            seen.add(n)
            yield n, dist
            if len(seen) == nodes:
                return

    def distance(self, c: int, n: int, present: bytearray) -> int:
        """Chunk c's distance to node ``n`` (which must have a present member)."""
        for m, dist in self.ranking(c, present):
            if m == n:
                return dist
        raise AssertionError(f"node {n} has no present member")


class Caps:
    """The most chunks each node may own, worked out per node on first use.

    ``max(ceil(S), floor((1 + slack - h) * S - u))`` for node n: ``S = count * g / world``
    is its even share for its ``g`` members, ``u = dithers[n] / 2**16``, ``slack`` in
    permille. ``h`` is 1% of headroom when a chunk's ``units`` do not split evenly among
    the ``g`` members (0 otherwise): the unit left over rotates with the chunk, so each
    member gets its share of leftovers to within a fraction of a percent, and the headroom
    keeps its slices within ``1 + slack`` of the mean. The dither spreads the moments at
    which caps step up as the world shrinks: without it every node's cap steps at once,
    and each full node then takes back a chunk it had turned away, a move the loss did not
    need. Lazy: after a loss only the nodes that are asked, or that have turned chunks
    away, need theirs.
    """

    def __init__(
        self,
        count: int,
        units: int,
        groups: Sequence[int],
        dithers: Sequence[int],
        slack: int,
        world: int,
    ) -> None:
        self._count, self._units, self._groups, self._dithers = count, units, groups, dithers
        self._slack, self._world = slack, world
        self._memo: dict[int, int] = {}

    def __getitem__(self, n: int) -> int:
        cap = self._memo.get(n)
        if cap is None:
            g, world, count = self._groups[n], self._world, self._count
            if g == 0:
                cap = 0
            else:
                room = 1000 + self._slack - (10 if self._units % g else 0)
                bound = (room * count * g << 16) - 1000 * world * self._dithers[n]
                cap = max(-(-count * g // world), bound // (1000 * world << 16))
            self._memo[n] = cap
        return cap
