"""Replicas and transfers for the chunked layout: copies on the assigned and next nodes.

Where it sits: the chunked counterpart of ``replicas`` and ``plan`` (which dispatch here:
``place_replicas`` and ``plan_transfers`` accept a ``ChunkLayout`` and its placement).

The rule
    Copy 1 of chunk c lives on ``nexts[c]``, the node the assignment gives its replica
    (``replica_assign``: the first node after its owner in c's ranking that has room for
    it under the load bound), so placing costs nothing and follows a derived layout's
    updates. Copy k > 1 lives on the (k-1)-th node after its owner in c's ranking, the
    owner's and copy 1's nodes passed by (ranked before the owner only if too few come
    after it). Each is cut among that node's members as the owner's node cuts it.

Why this node
    When the owner's node is lost, the chunk asks the nodes after its owner, in order: the
    first is where its replica mostly lives. If that node has room it becomes the owner
    with the data in place (nothing moves to owners); only the new replica is sent, by the
    node that kept the old one. Whether it has room, and whether the replica was moved on
    by the replicas' cap, is the load bound's business; the plan moves whatever the new
    assignment says, and ``bench/shard_plan.py`` counts it.

Transfers
    For every chunk whose holders or holders' members change, each new holder's slice is
    fetched where it lacks it, from the first live old holder counting from old copy
    ``k mod (R + 1)`` (as ``plan``: the old owner feeds the new owner, the old replica the
    new replica), slice by slice. After a derived layout (``ChunkLayout.relayout`` after a
    loss or a drain) only those chunks are visited: a few per lost member, not every chunk.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import lt

from keepstep.elastic.shard.blocks import Column
from keepstep.elastic.shard.chunks import ChunkLayout
from keepstep.elastic.shard.layout import Range, join_touching
from keepstep.elastic.shard.moves import Plan, ShardLost
from keepstep.errors import ConfigError

__all__ = ["ChunkPlacement", "place_chunk_replicas", "plan_chunk_transfers"]


@dataclass(frozen=True, eq=False)
class ChunkPlacement:
    """``copies[k][c]``: the ring node keeping copy k+1 of chunk c, cut among its members."""

    layout: ChunkLayout
    replicas: int
    copies: tuple[Column, ...]

    def holders(self, c: int) -> tuple[int, ...]:
        """Ring node numbers holding chunk c: owner first, then copies 1..R."""
        return (self.layout.owner_node(c), *(column[c] for column in self.copies))

    def holdings(self) -> Iterator[tuple[str, int, int, int]]:
        """``(member, start, stop, copy)`` for every non-empty slice a member holds."""
        lay = self.layout
        for c in range(lay.chunks):
            for k, n in enumerate(self.holders(c)):
                for m, (a, b) in lay.slices(c, n):
                    if b > a:
                        yield m, a, b, k

    def member_ranges(self) -> tuple[dict[str, tuple[Range, ...]], dict[str, tuple[Range, ...]]]:
        """Per member with any: the elements it owns (copy 0) and those it keeps (every
        copy), each sorted with touching ranges merged. What ``layout.ranges`` and
        ``holdings`` give, in one pass over the chunks that makes no object per slice
        (a sharded job computes it at every epoch it enters)."""
        lay = self.layout
        held_chunks: dict[int, list[int]] = {}  # node -> the chunks it holds, ascending
        owned_chunks: dict[int, set[int]] = {}
        owners = lay.assignment.owners
        for c in range(lay.chunks):
            owner = owners[c]
            held_chunks.setdefault(owner, []).append(c)
            owned_chunks.setdefault(owner, set()).add(c)
            for column in self.copies:
                held_chunks.setdefault(column[c], []).append(c)
        owned: dict[str, tuple[Range, ...]] = {}
        kept: dict[str, tuple[Range, ...]] = {}
        for n, members in lay.node_members.items():
            chunks, mine = held_chunks.get(n, []), owned_chunks.get(n, set())
            if len(members) == 1:  # one member takes each chunk whole
                size, total = lay.chunk, lay.total
                cuts: list[Sequence[int]] = [
                    (c * size, min(c * size + size, total)) for c in chunks
                ]
            else:
                cuts = [lay.cut(c, n) for c in chunks]
            for i, m in enumerate(members):
                own = join_touching(
                    (b[i], b[i + 1]) for c, b in zip(chunks, cuts, strict=True) if c in mine
                )
                every = join_touching((b[i], b[i + 1]) for b in cuts)
                if own:
                    owned[m] = own
                if every:
                    kept[m] = every
        return owned, kept

    def lost(self, live: Collection[str]) -> int:
        """Elements whose owner is not in ``live``."""
        lay = self.layout
        total = 0
        for n, members in lay.node_members.items():
            dead = [i for i, m in enumerate(members) if m not in live]
            for c in lay.chunks_of(n) if dead else ():
                cut = lay.slices(c, n)
                total += sum(cut[i][1].size for i in dead)
        return total

    def load(self) -> Counter[str]:
        """Replica elements kept per member (members keeping none are absent)."""
        out: Counter[str] = Counter()
        for m, a, b, k in self.holdings():
            if k:
                out[m] += b - a
        return out


def place_chunk_replicas(layout: ChunkLayout, replicas: int = 1) -> ChunkPlacement:
    """Where the ``replicas`` copies of every chunk live; see the module docstring.

    Raises :class:`ConfigError` when ``replicas`` is negative or not below the number of
    nodes (each copy needs a node of its own besides the owner's).
    """
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ConfigError(f"replicas={replicas!r} must be an int >= 0")
    nodes = len(layout.node_members)
    if replicas >= nodes:
        raise ConfigError(
            f"replicas={replicas} needs members on at least {replicas + 1} nodes (each copy "
            f"on a node other than the owner's), but the {len(layout)} members are on "
            f"{nodes} node(s); use replicas <= {nodes - 1}"
        )
    a = layout.assignment
    if replicas <= 1:
        return ChunkPlacement(layout, replicas, (a.nexts,) if replicas else ())
    columns: list[list[int]] = [[] for _ in range(replicas - 1)]
    for c in range(layout.chunks):
        owner, dist, first = a.owners[c], a.dists[c], a.nexts[c]
        after: list[int] = []
        before: list[int] = []
        for n, d in a.ring.ranking(c, a.present, a.live):
            if n == first:
                continue
            if d > dist:
                after.append(n)
                if len(after) == replicas - 1:
                    break
            elif n != owner:
                before.append(n)
        for k, n in enumerate((after + before)[: replicas - 1]):
            columns[k].append(n)
    return ChunkPlacement(layout, replicas, (a.nexts, *columns))


def _visit(old: ChunkPlacement, new: ChunkPlacement, dead: frozenset[str]) -> Iterable[int]:
    """The chunks whose holders, or the members cutting them, may have changed: after a
    derived layout, the moved chunks and those held by shrunk nodes or dead members."""
    ol, nl = old.layout, new.layout
    a = nl.assignment
    if a.parent is not ol.assignment or not old.replicas == new.replicas <= 1:
        return range(nl.chunks)
    ring = ol.ring
    nodes = set(a.shrunk)
    nodes.update(ring.member_node[ring.member_id[m]] for m in dead)
    chunks = set(a.moved)
    for n in nodes:
        for index in (ol.assignment.by_node, ol.assignment.by_next, a.by_node, a.by_next):
            chunks.update(index.get(n, ()))
    return sorted(chunks)


class _Columns:
    """The plan's columns as they are filled."""

    def __init__(self) -> None:
        self.src: list[str] = []
        self.dst: list[str] = []
        self.start: list[int] = []
        self.stop: list[int] = []
        self.copy: list[int] = []

    def add(self, src: str, dst: str, start: int, stop: int, copy: int) -> None:
        self.src.append(src)
        self.dst.append(dst)
        self.start.append(start)
        self.stop.append(stop)
        self.copy.append(copy)

    def pairs(self, src: Sequence[str], dst: Sequence[str], bounds: list[int], copy: int) -> None:
        """Member i of ``src`` sends slice i (``bounds``) to member i of ``dst``."""
        if all(map(lt, bounds, bounds[1:])):  # no slice is empty
            self.src += src
            self.dst += dst
            self.start += bounds[:-1]
            self.stop += bounds[1:]
            self.copy += [copy] * len(src)
            return
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            if bounds[i] < bounds[i + 1]:
                self.add(s, d, bounds[i], bounds[i + 1], copy)


def plan_chunk_transfers(
    old: ChunkPlacement, new: ChunkPlacement, live: Collection[str]
) -> Plan[ChunkPlacement]:
    """The moves from ``old`` (its ``live`` holders) to ``new``; see the module docstring.

    Raises :class:`ShardLost` when part of a chunk has no live holder, and
    :class:`ConfigError` when the layouts cut different state or ``live`` names a
    stranger.
    """
    ol, nl = old.layout, new.layout
    if (ol.sizes, ol.chunk) != (nl.sizes, nl.chunk):
        raise ConfigError(
            f"the old layout cuts {ol.total} elements of {len(ol.sizes)} tensors into chunks "
            f"of {ol.chunk}, the new one {nl.total} of {len(nl.sizes)} into {nl.chunk}: both "
            "must shard the same tensors the same way (use ChunkLayout.relayout)"
        )
    alive = frozenset(live)  # no copy when it is one already
    dead = ol.member_set - alive
    if len(alive) + len(dead) != len(ol):
        strangers = sorted(alive - ol.member_set)
        raise ConfigError(f"live={strangers[:6]} are not members of the old layout")
    old_names, new_names = ol.ring.nodes, nl.ring.nodes
    same_ring = ol.ring is nl.ring
    steady: dict[int, bool] = {}  # old node -> same members in both layouts, all live
    some: dict[int, bool] = {}  # old node -> has a live member

    def still(n: int) -> bool:
        known = steady.get(n)
        if known is None:
            members = ol.node_members[n]
            m = n if same_ring else nl.ring.node_id.get(old_names[n], -1)
            known = steady[n] = nl.node_members.get(m) == members and all(
                x in alive for x in members
            )
        return known

    def any_live(n: int) -> bool:
        known = some.get(n)
        if known is None:
            known = some[n] = any(x in alive for x in ol.node_members[n])
        return known

    out = _Columns()
    lost: list[Range] = []
    lost_by: list[str] = []
    old_columns = (ol.assignment.owners, *old.copies)
    new_columns = (nl.assignment.owners, *new.copies)
    node_members = nl.node_members
    for c in _visit(old, new, dead):
        holders = [column[c] for column in old_columns]
        after = [column[c] for column in new_columns]
        if same_ring:
            before: list[int] | list[str] = holders
            names: list[int] | list[str] = after
        else:
            before = [old_names[n] for n in holders]
            names = [new_names[n] for n in after]
        cuts: dict[int, list[int]] = {}  # old copy -> its node's cut of c
        for k, n in enumerate(after):
            j = before.index(names[k]) if names[k] in before else -1  # type: ignore[arg-type]
            if j >= 0 and still(holders[j]):
                continue  # that node's members hold their slices already
            members = node_members[n]
            if j < 0:  # new to the chunk: often the first live old copy is cut alike
                for t in range(len(holders)):
                    source = holders[(k + t) % len(holders)]
                    if any_live(source):
                        src = ol.node_members[source]
                        if still(source) and len(src) == len(members):
                            out.pairs(src, members, nl.cut(c, n), k)  # the source's cut too
                            j = -2
                        break
                if j == -2:
                    continue
            bounds = nl.cut(c, n)
            n_old = holders[j] if j >= 0 else -1
            for i, d in enumerate(members):
                parts = [(bounds[i], bounds[i + 1])] if bounds[i] < bounds[i + 1] else []
                if n_old >= 0 and d in alive and d in ol.node_members[n_old]:
                    oi = ol.node_members[n_old].index(d)
                    held = cuts.get(j) or cuts.setdefault(j, ol.cut(c, n_old))
                    parts = _subtract(parts, held[oi], held[oi + 1])
                for t in range(len(holders)):
                    if not parts:
                        break
                    jj = (k + t) % len(holders)
                    src_node = holders[jj]
                    cut = cuts.get(jj) or cuts.setdefault(jj, ol.cut(c, src_node))
                    parts = _fetch(parts, cut, ol.node_members[src_node], alive, d, k, out)
                if parts:
                    lost += [Range(a, b) for a, b in parts]
                    lost_by += [m for h in holders for m in ol.node_members[h]]
    if lost:
        raise ShardLost(lost, lost_by)
    return Plan(
        old=old,
        new=new,
        live=alive,
        src=tuple(out.src),
        dst=tuple(out.dst),
        start=tuple(out.start),
        stop=tuple(out.stop),
        copy=tuple(out.copy),
    )


def _subtract(parts: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in parts:
        if hi <= a or b <= lo:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo))
        if hi < b:
            out.append((hi, b))
    return out


def _fetch(
    parts: list[tuple[int, int]],
    cut: list[int],
    members: tuple[str, ...],
    alive: frozenset[str],
    dst: str,
    copy: int,
    out: _Columns,
) -> list[tuple[int, int]]:
    """Moves serving ``parts`` from the live members cutting one old copy; what is left
    (slices of dead members)."""
    left: list[tuple[int, int]] = []
    for a, b in parts:
        i = bisect_right(cut, a) - 1
        while i < len(members) and cut[i] < b:
            lo, hi = max(a, cut[i]), min(b, cut[i + 1])
            if lo < hi:
                if members[i] in alive:
                    out.add(members[i], dst, lo, hi, copy)
                else:
                    left.append((lo, hi))
            i += 1
    return left
