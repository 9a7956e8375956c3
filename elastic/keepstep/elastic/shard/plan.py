"""Transfer plan: the moves that take sharded state from one membership to the next.

Where it sits: the third pure step of sharded state, after ``layout`` and ``replicas``.
Once the agents agree on a new epoch, every member calls ``plan_transfers(old, new, live)``
with the same inputs, gets the same moves, and runs its own over the new epoch's
communicator as a timed recovery phase. ``live`` are the old members whose state survived
(their own shard and the replicas they keep): survivors, and drained members that send
before they leave. Joiners hold nothing and only receive. Placements of a chunked layout
go to ``copies.plan_chunk_transfers``, which follows the same rule chunk by chunk; both
return a :class:`~keepstep.elastic.shard.moves.Plan`.

The rule
    Walk the old and new shard boundaries together; every run of elements lies in one old
    shard and one new shard. Its destinations are the new owner (copy 0) and the holders of
    the new copies 1..R'. A destination that already holds the old shard (as its live
    owner or replica keeper) takes the run from its own memory: no move. Any other copy k
    comes from the first live holder of the old shard counting from old copy k mod (R+1),
    cyclically: the old owner feeds the new owner, the old copy-k keeper the new copy-k
    keeper, and a dead holder's share falls to the next live one. The rule is local, so a
    member could work out its own moves without listing the others'.

Bounds guaranteed (``tests/elastic/test_shard_plan.py`` checks them on random cases)
    receive  a member receives only elements it must hold afterwards and does not hold
             before: at most its new shard plus the new replicas it keeps.
    send     a member sends only elements of old shards it holds, each once per new copy
             whose scan stops at it: with R' = R and every holder of the shard alive, once;
             plus once more for each dead holder just before it in the scan. After a
             single-node loss with R = 1, at most twice what it holds; about one shard
             in the bench's clusters of equal nodes (``bench/shard_plan.py``).
    bytes    the moves carry exactly the elements destinations lack; how that compares with
             the lost shards is bounded by the layout (see ``layout``), and measured.

Double fault
    When every holder of a non-empty old shard is gone (its owner and all its replica
    keepers), no plan exists: ``plan_transfers`` raises ``ShardLost`` naming the lost
    elements and who held them, before any move is listed, so the caller falls back to the
    newest durable checkpoint instead of training on wrong numbers.
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import compress, count
from operator import not_
from typing import cast, overload

from keepstep.elastic.shard.copies import ChunkPlacement, plan_chunk_transfers
from keepstep.elastic.shard.layout import Range
from keepstep.elastic.shard.moves import Move, Plan, ShardLost
from keepstep.elastic.shard.replicas import Placement
from keepstep.errors import ConfigError

__all__ = ["Move", "Plan", "plan_transfers"]


@overload
def plan_transfers(old: Placement, new: Placement, live: Collection[str]) -> Plan[Placement]: ...


@overload
def plan_transfers(
    old: ChunkPlacement, new: ChunkPlacement, live: Collection[str]
) -> Plan[ChunkPlacement]: ...


def plan_transfers(
    old: Placement | ChunkPlacement, new: Placement | ChunkPlacement, live: Collection[str]
) -> Plan[Placement] | Plan[ChunkPlacement]:
    """The moves from ``old`` (its ``live`` holders) to ``new``; see the module docstring
    (chunked placements: ``copies``).

    Raises :class:`ShardLost` when a non-empty old shard has no live holder, and
    :class:`ConfigError` when the layouts cover different tensors, are of different kinds,
    or ``live`` names a member the old layout does not have.
    """
    if isinstance(old, ChunkPlacement) and isinstance(new, ChunkPlacement):
        return plan_chunk_transfers(old, new, live)
    if not isinstance(old, Placement) or not isinstance(new, Placement):
        raise ConfigError(
            f"cannot plan from a {type(old).__name__} to a {type(new).__name__}: both "
            "layouts must be of one kind (make_layout or make_chunk_layout)"
        )
    return _plan_contiguous(old, new, live)


def _plan_contiguous(old: Placement, new: Placement, live: Collection[str]) -> Plan[Placement]:
    src_layout, dst_layout = old.layout, new.layout
    if src_layout.sizes != dst_layout.sizes:
        raise ConfigError(
            f"the old layout shards {len(src_layout.sizes)} tensors, {src_layout.total} "
            f"elements; the new one {len(dst_layout.sizes)}, {dst_layout.total}: both must "
            "shard the same tensors"
        )
    alive = frozenset(live)
    strangers = sorted(alive.difference(src_layout.members))
    if strangers:
        raise ConfigError(f"live={strangers[:6]} are not members of the old layout")

    # Column t: the live keeper of copy t of each old shard, None where it is gone. Built
    # by copying and blanking the dead, so the cost in Python steps is the dead, not W.
    cols: list[list[str | None]] = []
    dead: list[list[int]] = []
    for column in (src_layout.members, *old.copies):
        gone = list(compress(count(), map(not_, map(alive.__contains__, column))))
        col: list[str | None] = list(column)
        for i in gone:
            col[i] = None
        cols.append(col)
        dead.append(gone)
    n_old = len(cols)
    # sources[k][i]: who sends old shard i's elements to a new copy-k destination: the
    # first live keeper counting from old copy k mod n_old; None when every one is gone.
    sources: list[list[str | None]] = []
    for k in range(new.replicas + 1):
        first = k % n_old
        source = list(cols[first])
        for i in dead[first]:
            for t in range(1, n_old):
                keeper = cols[(first + t) % n_old][i]
                if keeper is not None:
                    source[i] = keeper
                    break
        sources.append(source)
    ob = src_layout.bounds
    if any(sources[0][i] is None for i in dead[0]):  # no live holder at all: lost?
        _check_lost(old, sources[0])
    # "Does d hold old shard i?": against the first two columns directly, and the rest as
    # tuples only when there are more (tuples per shard wake the garbage collector).
    c0, c1 = cols[0], cols[min(1, n_old - 1)]
    more = list(zip(*cols[2:], strict=True)) if n_old > 2 else None
    dests: list[tuple[str, ...]] = [dst_layout.members]
    dests += new.copies
    slots = list(zip(range(len(dests)), dests, sources, strict=True))

    nb = dst_layout.bounds
    total = src_layout.total
    src: list[str | None] = []
    dst: list[str] = []
    begin: list[int] = []
    end_: list[int] = []
    copy: list[int] = []
    add_src, add_dst, add_begin, add_end, add_copy = (
        src.append,
        dst.append,
        begin.append,
        end_.append,
        copy.append,
    )
    i = j = pos = 0
    while pos < total:
        oe, ne = ob[i + 1], nb[j + 1]
        end = oe if oe < ne else ne
        if end > pos:
            h0, h1 = c0[i], c1[i]
            for k, dest, source in slots:
                d = dest[j]
                if d != h0 and d != h1 and (more is None or d not in more[i]):
                    add_src(source[i])
                    add_dst(d)
                    add_begin(pos)
                    add_end(end)
                    add_copy(k)
            pos = end
        if oe == end:
            i += 1
        if ne == end:
            j += 1
    # _check_lost made sure every run has a live source: no None is left in src.
    senders = cast("tuple[str, ...]", tuple(src))
    return Plan(old, new, alive, senders, tuple(dst), tuple(begin), tuple(end_), tuple(copy))


def _check_lost(old: Placement, anyone: list[str | None]) -> None:
    # ``anyone[i]`` is some live holder of old shard i, None when there is none.
    bounds, members = old.layout.bounds, old.layout.members
    lost = [i for i, s in enumerate(anyone) if s is None and bounds[i + 1] > bounds[i]]
    if lost:
        raise ShardLost(
            [Range(bounds[i], bounds[i + 1]) for i in lost],
            [x for i in lost for x in (members[i], *(column[i] for column in old.copies))],
        )
