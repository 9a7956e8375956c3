"""Who steps which elements of the flattened parameters, and the windows a member steps.

Where it sits: the first piece of ZeRO-1's data plane. The shard layout
(``keepstep.elastic.shard.layout``) decides who owns which elements; an ``Ownership`` is
that decision in the communicator's rank order, checked here once: every element of the
flattened parameters has exactly one owner. A rank may own several ranges (a chunk set),
not only one contiguous slice. Torch-free, like the layout.

Windows, and why they are wider than the owned pieces
    The optimizer runs on 1-D views of the parameters. An elementwise CPU kernel does not
    compute every element the same way: the body of a tensor goes through vector lanes,
    the last ``len % (2 * lanes)`` elements through a scalar loop, and for some kernels
    (bf16 ``add_``, the fused SGD) the two round differently. Which path an element takes
    depends on its offset from the start of the tensor the kernel is handed. So a member
    steps each owned piece inside a *window*: the piece widened to multiples of ``align``
    elements from the start of the parameter (and clipped at its end). Every element then
    sits at the same place in the vector loop as in the unsharded step, and gets the same
    bits. The extra elements (less than ``2 * align`` per piece) are scratch lanes: they are
    stepped too, but their owner's copy wins in the all-gather, and their optimizer state is
    never exported. ``align`` must be a multiple of every vector loop's stride (64 bytes of
    lanes, unrolled twice, for bf16 on AVX-512: 64 elements); 128 leaves room.

    With more than one intra-op thread torch also cuts a large tensor (over 32768
    elements) between threads at positions a window cannot see; the job's default of one
    thread (``JobConfig.threads``) avoids that (see zero/optimizer.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import NamedTuple

from keepstep.elastic.shard.chunks import ChunkLayout
from keepstep.elastic.shard.layout import Layout, Piece, Range, balanced_bounds, pieces_of
from keepstep.errors import ConfigError

__all__ = ["ALIGN", "Ownership", "Window", "windows"]

ALIGN = 128


class Window(NamedTuple):
    """Elements ``[start, stop)`` of tensor ``tensor`` stepped together on one rank;
    ``owned`` are the pieces of it that rank owns (offsets inside the tensor)."""

    tensor: int
    start: int
    stop: int
    owned: tuple[Range, ...]


@dataclass(frozen=True)
class Ownership:
    """``ranges[r]``: the elements of the flattened ``sizes`` that rank ``r`` owns.

    Each rank's ranges are sorted and disjoint; together the ranks cover
    ``[0, sum(sizes))`` exactly once (checked at construction). Build one from a shard
    layout (``from_layout``, ``from_chunk_layout``) or as balanced contiguous slices
    (``balanced``).
    """

    sizes: tuple[int, ...]
    ranges: tuple[tuple[Range, ...], ...]
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _starts: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    # Each rank's pieces, cut once: every member asks for every rank's (the gather, the
    # snapshot exchange, ZeRO-2's reduce-scatter) when it enters an epoch.
    _pieces: dict[int, tuple[Piece, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        try:
            ranges = tuple(
                tuple(r if type(r) is Range else Range(*r) for r in mine) for mine in self.ranges
            )
        except TypeError:
            raise ConfigError(
                f"ranges must list (start, stop) pairs per rank, got {self.ranges!r}"[:300]
            ) from None
        object.__setattr__(self, "sizes", tuple(self.sizes))
        object.__setattr__(self, "ranges", ranges)
        for i, n in enumerate(self.sizes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"sizes[{i}]={n!r} must be an int >= 0")
        if not self.ranges:
            raise ConfigError("ranges=() must list the ranges of at least one rank")
        offsets = (0, *accumulate(self.sizes))
        total = offsets[-1]
        starts: list[tuple[int, int, int]] = []
        for rank, mine in enumerate(self.ranges):
            last = -1
            for r in mine:
                if not all(isinstance(x, int) for x in r) or not 0 <= r.start < r.stop <= total:
                    raise ConfigError(
                        f"rank {rank}: range {r!r} must be a non-empty Range inside [0, {total})"
                    )
                if r.start < last:
                    raise ConfigError(f"rank {rank}: ranges must be sorted and disjoint")
                last = r.stop
                starts.append((r.start, r.stop, rank))
        starts.sort()
        covered = 0
        for start, stop, _rank in starts:
            if start != covered:
                what = "owned twice" if start < covered else "owned by no rank"
                at = min(start, covered)
                raise ConfigError(f"element {at} is {what}: every element needs one owner")
            covered = stop
        if covered != total:
            raise ConfigError(f"element {covered} is owned by no rank: every element needs one")
        object.__setattr__(self, "_offsets", offsets)
        object.__setattr__(self, "_starts", tuple((s, rank) for s, _, rank in starts))

    @classmethod
    def from_layout(cls, layout: Layout, ranks: Sequence[str]) -> Ownership:
        """The layout's shards in rank order: ``ranks[r]`` is the member at rank ``r``
        (the communicator's sorted members)."""
        if sorted(ranks) != sorted(layout.members):
            raise ConfigError(
                f"ranks {list(ranks)[:6]} must be the layout's members {list(layout.members)[:6]}"
            )
        shards = (layout.shard(m) for m in ranks)
        return cls(layout.sizes, tuple((s,) if s.size else () for s in shards))

    @classmethod
    def from_chunk_layout(cls, layout: ChunkLayout, ranks: Sequence[str]) -> Ownership:
        """A chunked layout's owned ranges (many per member) in rank order: ``ranks[r]``
        is the member at rank ``r``. Build the layout with ``align=ALIGN`` so every range
        starts on a window boundary and windows stay as narrow as the pieces."""
        if sorted(ranks) != sorted(layout.members):
            raise ConfigError(
                f"ranks {list(ranks)[:6]} must be the layout's members {list(layout.members)[:6]}"
            )
        return cls(layout.sizes, tuple(layout.ranges(m) for m in ranks))

    @classmethod
    def balanced(cls, sizes: Iterable[int], world: int, align: int = 1) -> Ownership:
        """Rank ``r`` owns the ``r``-th of ``world`` balanced contiguous slices."""
        counts = tuple(sizes)
        bounds = balanced_bounds(sum(counts), world, align)
        pairs = pairwise(bounds)
        return cls(counts, tuple((Range(a, b),) if b > a else () for a, b in pairs))

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def total(self) -> int:
        return self._offsets[-1]

    def owned(self, rank: int) -> int:
        """Elements rank ``rank`` owns."""
        return sum(r.size for r in self._mine(rank))

    def pieces(self, rank: int) -> list[Piece]:
        """Rank ``rank``'s ranges as slices of the tensors, in flattened order."""
        cut = self._pieces.get(rank)
        if cut is None:
            mine = self._mine(rank)
            cut = tuple(p for a, b in mine for p in pieces_of(self._offsets, a, b))
            self._pieces[rank] = cut
        return list(cut)

    def owner_of(self, element: int) -> int:
        """The rank owning flattened element ``element``."""
        if not 0 <= element < self.total:
            raise ConfigError(f"element={element} is outside [0, {self.total})")
        return self._starts[bisect_right(self._starts, (element, self.world)) - 1][1]

    def anchor(self, tensor: int) -> int:
        """The rank that keeps tensor ``tensor``'s per-tensor values (Adam's step count)
        for the gathered state: the owner of its first element. An empty tensor has none;
        it goes to the owner of the element after it (the last rank's at the end)."""
        offset = self._offsets[tensor]
        if self.total == 0:
            return 0
        return self.owner_of(min(offset, self.total - 1))

    def _mine(self, rank: int) -> tuple[Range, ...]:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ConfigError(f"rank={rank!r} must be an int in [0, {self.world})")
        return self.ranges[rank]


def windows(
    ownership: Ownership, rank: int, tensors: Iterable[int], align: int = ALIGN
) -> list[Window]:
    """The windows rank ``rank`` steps for ``tensors`` (the optimized ones), in order.

    Each owned piece widens to multiples of ``align`` from its tensor's start, clipped at
    the tensor's end; windows that touch merge. The rank that anchors an empty tensor gets
    an empty window for it, so the tensor's per-tensor state exists somewhere.
    """
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ConfigError(f"align={align!r} must be an int >= 1")
    wanted = set(tensors)
    sizes = ownership.sizes
    out: list[Window] = []
    for t, a, b in ownership.pieces(rank):
        if t not in wanted:
            continue
        start = a // align * align
        stop = min(sizes[t], -(-b // align) * align)
        if out and out[-1].tensor == t and out[-1].stop >= start:
            last = out[-1]
            out[-1] = Window(t, last.start, max(last.stop, stop), (*last.owned, Range(a, b)))
        else:
            out.append(Window(t, start, stop, (Range(a, b),)))
    for t in sorted(wanted):
        if sizes[t] == 0 and ownership.anchor(t) == rank:
            out.append(Window(t, 0, 0, ()))
    out.sort(key=lambda w: (w.tensor, w.start))
    return out
