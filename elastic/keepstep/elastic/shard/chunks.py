"""Chunked layout: fixed chunks of the flattened state, owned by nodes under a load bound.

Where it sits: the second layout mode beside ``layout`` (one balanced contiguous slice per
member). It answers the same questions (who owns which elements, in which tensor pieces;
``Ownership.from_chunk_layout`` gives the ZeRO data plane its ranges), and ``replicas`` /
``plan`` accept it. What differs is what a change costs: after a node is lost the node
that kept the replica of each lost chunk is the one that owns it next, so owners fetch
(almost) nothing; a join takes about its share; only what the load bound forces moves
besides. Pure and torch-free, like the rest of ``shard``.

The rule
    Chunks. The state is cut into ``ceil(total / chunk)`` chunks of ``chunk`` elements (a
    multiple of ``align``; the last may be shorter). ``chunk`` is fixed for the life of a
    job: :func:`chunk_size` picks it once, and :meth:`ChunkLayout.relayout` keeps it.
    Ranking. Each chunk ranks the nodes by a fixed order over all possible member names
    (``ring``: points per member on a circle, probed per chunk), so a member coming or
    going changes no other node's place in any ranking: rendezvous hashing, with a rank
    found by bisection rather than by scoring every node.
    Owners. Node n may own at most about ``(1 + slack) * S`` chunks, ``S = chunks *
    members(n) / W`` its even share (``ring.Caps``). Owners are the unique stable
    assignment in which chunks prefer nodes by rank and nodes prefer chunks by the same
    distance (``assign``): most chunks sit at their first node; the bound sends the rest
    down their rankings. It does not depend on the order chunks are processed in.
    Inside a node. Each chunk a node owns is cut into even ``align``-multiple slices, one
    per member in layout order (a unit left over by rounding rotates with the chunk).

Why nodes own chunks, and members slices
    Nodes fail whole, so the node is the unit that must hand its chunks on. A chunk's
    replica lives, under the same bound, on the first node other than its owner's in its
    ranking that has room (``replica_assign``), mostly the next node after its owner, cut
    the same way among that node's members (``copies``); when the owner's node is lost the
    assignment resumes at that node, and its members own what they already keep. Bounding per node
    also sees about 512 chunks per node rather than 64 per member, so the sampling noise
    of a node's load is ~4.4% instead of ~12%, the 10% bound seldom binds, and it forces
    few moves (2-3% of a loss at 1,000-100,000 members; ``bench/shard_plan.py``). With 256
    per node it bound four times as often and forced 5-12%. The price: a member that
    joins or leaves a node that stays re-cuts that node's chunks (moves within the node).

Cost
    A fresh layout asks once per chunk (seconds at 10,000 members, minutes at 100,000:
    job start, and a join, which can be computed while the joiner is pending). After a
    loss or a drain, :meth:`ChunkLayout.without` derives the next layout from this one at
    the cost of the chunks that move (``assign.without``), and the plan visits only those.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, reduce
from itertools import accumulate, filterfalse
from math import lcm

from keepstep.elastic.shard.assign import Assignment, assign, without
from keepstep.elastic.shard.layout import (
    Piece,
    Range,
    join_touching,
    layout_order,
    node_of,
    pieces_of,
)
from keepstep.elastic.shard.ring import Ring
from keepstep.errors import ConfigError

__all__ = ["ChunkLayout", "chunk_size", "make_chunk_layout"]

PER_MEMBER = 32  # chunk_size aims at >= this many chunks per member ...
PER_NODE = 512  # ... and per node, so the bound seldom binds
MAX_CHUNKS = 1 << 23


def chunk_size(total: int, members: Sequence[str], align: int = 1) -> int:
    """Elements per chunk for a job starting with ``members``, to keep for its life.

    About ``max(32 * members, 512 * nodes)`` chunks (at most 2**23), each a multiple of
    ``align``. The unit count per chunk is rounded up to a multiple of the node sizes'
    least common multiple, so each member's slice of a chunk is whole units and slices
    are equal; if that is too coarse, to the nearest multiple of the largest node's size
    (up only past 2**23 chunks).
    """
    units = -(-total // align)
    sizes = Counter(node_of(m) for m in members).values()
    target = min(max(PER_MEMBER * sum(sizes), PER_NODE * len(sizes)), MAX_CHUNKS)
    per = max(1, -(-units // target))
    step = reduce(lcm, sizes, 1)
    if step <= per:
        return -(-per // step) * step * align
    # Too coarse: a multiple of the largest node's size, the nearest one (rounding up
    # could halve the chunks, and the small nodes' loads would be the noisier for it).
    step = max(sizes, default=1)
    near = max(step, (2 * per + step) // (2 * step) * step)
    if -(-units // near) > MAX_CHUNKS:
        near = -(-per // step) * step
    return near * align


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Who owns what: chunk c belongs to node ``owner_node(c)``, cut among its members.

    ``members`` are in layout order (:func:`~keepstep.elastic.shard.layout.layout_order`).
    Build one with :func:`make_chunk_layout`; :meth:`relayout` gives the next membership's
    with the same chunks. Nodes are numbered by the shared ring (``ring.nodes``).
    """

    members: tuple[str, ...]
    sizes: tuple[int, ...]
    align: int
    chunk: int
    slack: float
    assignment: Assignment = field(repr=False)
    _offsets: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_offsets", (0, *accumulate(self.sizes)))

    @property
    def ring(self) -> Ring:
        return self.assignment.ring

    @property
    def total(self) -> int:
        return self._offsets[-1]

    @property
    def chunks(self) -> int:
        return self.assignment.count

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return member in self._index

    @cached_property
    def _index(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.members)}

    def index(self, member: str) -> int:
        """The member's position in layout order."""
        try:
            return self._index[member]
        except KeyError:
            raise ConfigError(f"member={member!r} is not in this layout") from None

    @cached_property
    def node_members(self) -> dict[int, tuple[str, ...]]:
        """Ring node number -> its members here, in layout order."""
        out: dict[int, list[str]] = {}
        ring = self.ring
        for m in self.members:
            out.setdefault(ring.member_node[ring.member_id[m]], []).append(m)
        return {n: tuple(ms) for n, ms in out.items()}

    def chunks_of(self, node: int) -> array[int]:
        """The chunks ring node ``node`` owns, in order."""
        return self.assignment.by_node.get(node, array("i"))

    def chunk_range(self, c: int) -> Range:
        start = c * self.chunk
        return Range(start, min(start + self.chunk, self.total))

    def owner_node(self, c: int) -> int:
        """The ring node number owning chunk c."""
        return self.assignment.owners[c]

    def cut(self, c: int, node: int) -> list[int]:
        """Where chunk c is cut among the g members of ring node ``node``: g + 1 bounds;
        member i (in layout order) gets ``[bounds[i], bounds[i + 1])``. The owner's cut
        gives the shards; a replica keeper's node keeps its copy cut the same way. Member
        i gets one unit more than the others when ``(i - c) mod g`` is below the leftover."""
        g = len(self.node_members[node])
        start = c * self.chunk
        stop = min(start + self.chunk, self.total)
        base, extra = divmod(-(-(stop - start) // self.align), g)
        if not extra:  # the usual case: chunk_size makes the units split evenly
            bounds = list(range(start, start + g * base * self.align + 1, base * self.align or 1))
            if base == 0:
                bounds = [start] * (g + 1)
            bounds[-1] = stop
            return bounds
        bounds = [start]
        for i in range(g):
            start += (base + ((i - c) % g < extra)) * self.align
            bounds.append(start if start < stop else stop)
        return bounds

    def slices(self, c: int, node: int) -> list[tuple[str, Range]]:
        """Chunk c cut among the members of ring node ``node`` (see :meth:`cut`): one
        ``(member, range)`` per member in layout order; a range may be empty."""
        b = self.cut(c, node)
        return [(m, Range(b[i], b[i + 1])) for i, m in enumerate(self.node_members[node])]

    def _slot(self, member: str) -> tuple[int, int]:
        self.index(member)
        ring = self.ring
        n = ring.member_node[ring.member_id[member]]
        return n, self.node_members[n].index(member)

    def ranges(self, member: str) -> tuple[Range, ...]:
        """The elements ``member`` owns, sorted, touching ranges merged."""
        n, i = self._slot(member)
        return join_touching(self.slices(c, n)[i][1] for c in self.chunks_of(n))

    def pieces(self, member: str) -> list[Piece]:
        """The member's ranges as slices of the flattened tensors (empty tensors skipped)."""
        return [p for a, b in self.ranges(member) for p in pieces_of(self._offsets, a, b)]

    def owner_of(self, element: int) -> str:
        """The member that owns flattened element ``element``."""
        if not 0 <= element < self.total:
            raise ConfigError(f"element={element} is outside [0, {self.total})")
        c = element // self.chunk
        for m, r in self.slices(c, self.owner_node(c)):
            if element < r.stop:
                return m
        raise AssertionError("the slices cover their chunk")

    def shard_sizes(self) -> list[int]:
        """Elements each member owns, in ``members`` order."""
        owned = dict.fromkeys(self.members, 0)
        for n in self.node_members:
            for c in self.chunks_of(n):
                for m, r in self.slices(c, n):
                    owned[m] += r.size
        return [owned[m] for m in self.members]

    def relayout(self, members: Iterable[str]) -> ChunkLayout:
        """The layout of the same state and chunks over ``members``: :func:`make_chunk_layout`
        with this layout's sizes, ``align``, ``chunk`` and ``slack``. When ``members`` only
        drops some of these (a loss, a drain) it is derived from this one (:meth:`without`)."""
        listed = list(members)
        keep = set(listed)
        removed = self.member_set - keep
        if len(keep) != len(listed) or len(keep) + len(removed) != len(self) or not keep:
            return make_chunk_layout(
                self.sizes, listed, align=self.align, chunk=self.chunk, slack=self.slack
            )
        return self.without(removed)

    def without(self, leaving: Iterable[str]) -> ChunkLayout:
        """The layout without the members ``leaving`` (lost or drained), derived from this
        one at the cost of what moves: equal to :func:`make_chunk_layout` over the rest."""
        removed = frozenset(leaving)
        strangers = sorted(m for m in removed if m not in self._index)
        if strangers or len(removed) >= len(self):
            what = f"{strangers[:6]} are not members" if strangers else "no member would stay"
            raise ConfigError(f"cannot remove {sorted(removed)[:6]}: {what}")
        order = tuple(filterfalse(removed.__contains__, self.members))  # still in order
        if 2 * len(order) < len(self.ring.members):  # most points would be skipped: rebuild
            return make_chunk_layout(
                self.sizes, order, align=self.align, chunk=self.chunk, slack=self.slack
            )
        out = ChunkLayout(
            order, self.sizes, self.align, self.chunk, self.slack, without(self.assignment, removed)
        )
        node_members = dict(self.node_members)
        for n in out.assignment.shrunk:
            mine = tuple(m for m in node_members.pop(n) if m not in removed)
            if mine:
                node_members[n] = mine
        # What the cached properties would compute, from this layout's in O(removed).
        out.__dict__["node_members"] = node_members
        if "member_set" in self.__dict__:
            out.__dict__["member_set"] = self.member_set - removed
        return out

    @cached_property
    def member_set(self) -> frozenset[str]:
        return frozenset(self.members)


def _check_int(name: str, value: object, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name}={value!r} must be an int >= {least}")
    return value


def make_chunk_layout(
    sizes: Sequence[int] | int,
    members: Iterable[str],
    *,
    align: int = 1,
    chunk: int | None = None,
    slack: float = 0.1,
) -> ChunkLayout:
    """The chunked layout of ``sizes`` over ``members``; see the module docstring.

    A pure function of the sizes, the member *set*, ``align``, ``chunk`` (default
    :func:`chunk_size` of these members) and ``slack``. Raises :class:`ConfigError`
    naming a bad value.
    """
    if isinstance(sizes, int):
        counts: tuple[int, ...] = (_check_int("total", sizes, 0),)
    else:
        counts = tuple(sizes)
        for i, n in enumerate(counts):
            _check_int(f"sizes[{i}]", n, 0)
    _check_int("align", align, 1)
    order = layout_order(members)
    total = sum(counts)
    if chunk is None:
        chunk = chunk_size(total, order, align)
    _check_int("chunk", chunk, 1)
    if chunk % align:
        raise ConfigError(f"chunk={chunk} must be a multiple of align={align}")
    if not isinstance(slack, float | int) or isinstance(slack, bool) or not 0 <= slack <= 1:
        raise ConfigError(f"slack={slack!r} must be a number in [0, 1]")
    count = -(-total // chunk)
    return ChunkLayout(
        order,
        counts,
        align,
        chunk,
        float(slack),
        assign(Ring(order), count, chunk // align, round(slack * 1000)),
    )
