"""Shard layout: the contiguous slice of the flattened state that each member owns.

Where it sits: the first of the three pure steps of sharded optimizer state.
``layout`` says who owns which elements, ``replicas`` who keeps a copy of each shard on
another node, and ``plan`` turns (old layout and copies, survivors) into the moves that
reach the new ones. Every member computes the same answer from the same membership, so
none of it travels over the wire, and none of it imports torch.

The rule
    The state is the concatenation of the flattened tensors (``sizes``, in order): ``total``
    elements. Members are put in *interleaved* order, sorted by (local worker id, node),
    so neighbours along the state sit on different nodes: n0/0 n1/0 n2/0 n0/1 n1/1 n2/1 ...
    The i-th member in that order owns the i-th of W contiguous shards. Boundaries fall on
    multiples of ``align`` elements (default 1): cut j sits at ``floor(j * units / W)``
    units (``units = ceil(total / align)``), so shard sizes differ by at most ``align``; the
    last shard always has the rounded-up unit count, so the short tail unit (when ``align``
    does not divide ``total``) sits in a long shard.

Why this order
    A member's sort key is its own name, never its rank among the others, so a loss, a
    join or a drain keeps the survivors' relative order, and the layout depends only on
    the member *set* (the order the caller lists them in does not matter). Interleaving by
    node puts each member's right-hand neighbour on another node: ``replicas`` keeps the
    replica there, so after a loss the survivors that take over leftwards already hold
    what they take over.

As little as possible
    Exact balance pins the new boundaries; a pure layout cannot know who left or joined,
    so the one freedom it has is the ranking of names, and a fixed ranking keeps the
    survivors' relative order. The owners that change are then exactly those the re-cut
    boundaries force: for a loss at position k of W, ``owner_changes(old, new)`` is
    ``(k(k+1)/2 + (W-1-k)(W-k)/2) / (W(W-1))`` of the state, a quarter (k in the middle)
    to a half (k at an end), against ``1/W`` for the lost shard itself. An order chosen
    knowing who left can keep a little more in place (tests: at most 17% fewer changes for
    a loss, 22% for a join, at W <= 7) but is no function of the members. ``plan`` serves
    part of the rest from replicas kept next door; what remains is measured by tests and
    ``bench/shard_plan.py``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate, repeat
from operator import floordiv, le, mul
from typing import NamedTuple

from keepstep.errors import ConfigError

__all__ = [
    "Layout",
    "Piece",
    "Range",
    "balanced_bounds",
    "join_touching",
    "layout_order",
    "make_layout",
    "node_of",
    "overlaps",
    "owner_changes",
]


class Range(NamedTuple):
    """Elements ``[start, stop)`` of the flattened state."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of tensor number ``tensor`` (offsets inside that tensor)."""

    tensor: int
    start: int
    stop: int


def join_touching(bounds: Iterable[tuple[int, int]]) -> tuple[Range, ...]:
    """Ascending, disjoint ``(start, stop)`` pairs (or ranges) as ranges, touching ones
    joined and empty ones dropped: no sort, and no object made per pair."""
    out: list[list[int]] = []
    for a, b in bounds:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple(Range(a, b) for a, b in out)


def pieces_of(offsets: Sequence[int], start: int, stop: int) -> list[Piece]:
    """Flattened elements ``[start, stop)`` as slices of the tensors whose flattened
    offsets are ``offsets`` (each tensor's start, then the total); empty tensors skipped."""
    out: list[Piece] = []
    t = bisect_right(offsets, start) - 1
    while start < stop:
        end = min(offsets[t + 1], stop)
        if end > start:
            out.append(Piece(t, start - offsets[t], end - offsets[t]))
        start = end
        t += 1
    return out


def _split(member: str) -> tuple[str, str]:
    if not isinstance(member, str):
        raise ConfigError(f"member={member!r} must be a str like 'n0/1' (node/local worker)")
    node, sep, local = member.rpartition("/")
    if not sep or not node or not local:
        raise ConfigError(f"member={member!r} must look like 'node/local' (e.g. 'n0/1')")
    return node, local


def node_of(member: str) -> str:
    """The node of a member: the part before the last '/' ("n0" for "n0/1")."""
    return _split(member)[0]


def layout_order(members: Iterable[str]) -> tuple[str, ...]:
    """The members in layout order: by (local worker id, node), interleaving the nodes.

    Ids compare by length first, so numeric ids sort naturally ("n2/3" before "n10/3").
    Raises :class:`ConfigError` on a duplicate, an empty list or a name without a node.
    """
    listed = list(members)
    if not listed:
        raise ConfigError("members=[] must name at least one member")
    try:
        locals_ = [m.rpartition("/")[2] for m in listed]
    except AttributeError:
        bad = [m for m in listed if not isinstance(m, str)]
        raise ConfigError(f"members {bad[:6]} must be str like 'n0/1' (node/local)") from None
    # Bucket by (local id, length of the name): inside a bucket every name ends in the
    # same "/local", so plain string order is node order. Linear, then small sorts.
    buckets: dict[tuple[int, str, int], list[str]] = {}
    for local, m in zip(locals_, listed, strict=True):
        key = (len(local), local, len(m))
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [m]
        else:
            bucket.append(m)
    # An empty local id, or a node part of length 0 (no '/', or a leading one).
    if any(n_local == 0 or n - n_local <= 1 for n_local, _, n in buckets):
        for m in listed:
            _split(m)
    if len(set(listed)) != len(listed):
        dups = sorted(m for m, n in Counter(listed).items() if n > 1)
        raise ConfigError(f"members lists {dups[:6]} more than once; each owns one shard")
    ordered: list[str] = []
    for key in sorted(buckets):
        bucket = buckets[key]
        bucket.sort()
        ordered += bucket
    return tuple(ordered)


def _check_count(name: str, value: object, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{name}={value!r} must be an int >= {least}")
    return value


def balanced_bounds(total: int, count: int, align: int = 1) -> list[int]:
    """``count + 1`` boundaries cutting ``total`` elements into balanced contiguous shards.

    Inner boundaries are multiples of ``align``; sizes differ by at most ``align``.
    """
    _check_count("total", total, 0)
    _check_count("count", count, 1)
    _check_count("align", align, 1)
    units = -(-total // align)
    # Proportional cuts (floor(j * units / count)) rather than all the long shards at one
    # end: every boundary stays within one unit of j/count of the state, so layouts of
    # different sizes agree wherever their members agree (a node loss keeps each round).
    # Only the last cut can pass the total (by the short tail unit).
    if units == 0:
        return [0] * (count + 1)
    cuts = map(floordiv, range(0, units * count + 1, units), repeat(count))
    bounds = list(map(mul, cuts, repeat(align))) if align > 1 else list(cuts)
    bounds[-1] = total
    return bounds


@dataclass(frozen=True)
class Layout:
    """Who owns what: ``members[i]`` owns elements ``[bounds[i], bounds[i + 1])``.

    ``members`` is in layout order (see :func:`layout_order`); ``sizes`` are the element
    counts of the flattened tensors whose concatenation is sharded. Build one with
    :func:`make_layout`.
    """

    members: tuple[str, ...]
    bounds: tuple[int, ...]
    sizes: tuple[int, ...]
    align: int = 1
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.members) + 1:
            raise ConfigError(
                f"bounds has {len(self.bounds)} entries; {len(self.members)} members need "
                f"{len(self.members) + 1}"
            )
        offsets = (0, *accumulate(self.sizes))
        if self.bounds[0] != 0 or self.bounds[-1] != offsets[-1]:
            raise ConfigError(
                f"bounds must run from 0 to total={offsets[-1]}, got "
                f"{self.bounds[0]}..{self.bounds[-1]}"
            )
        if not all(map(le, self.bounds, self.bounds[1:])):
            raise ConfigError("bounds must not decrease")
        object.__setattr__(self, "_offsets", offsets)

    @cached_property
    def _index(self) -> dict[str, int]:
        # Built on first use: the plan walks positions and never needs it.
        index = {m: i for i, m in enumerate(self.members)}
        if len(index) != len(self.members):
            raise ConfigError("members must be unique")
        return index

    @property
    def total(self) -> int:
        """Elements in the flattened state."""
        return self.bounds[-1]

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, member: object) -> bool:
        return member in self._index

    def index(self, member: str) -> int:
        """The member's position in layout order."""
        try:
            return self._index[member]
        except KeyError:
            raise ConfigError(f"member={member!r} is not in this layout") from None

    def shard(self, member: str) -> Range:
        """The elements ``member`` owns."""
        return self.shard_at(self.index(member))

    def shard_at(self, position: int) -> Range:
        return Range(self.bounds[position], self.bounds[position + 1])

    def owner_of(self, element: int) -> str:
        """The member that owns flattened element ``element``."""
        if not 0 <= element < self.total:
            raise ConfigError(f"element={element} is outside [0, {self.total})")
        return self.members[bisect_right(self.bounds, element) - 1]

    def pieces(self, member: str) -> list[Piece]:
        """The member's shard as slices of the flattened tensors (empty tensors skipped)."""
        return pieces_of(self._offsets, *self.shard(member))

    def shard_sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]


def make_layout(sizes: Sequence[int] | int, members: Iterable[str], *, align: int = 1) -> Layout:
    """The layout of ``sizes`` (flattened element counts, or one total) over ``members``.

    A pure function of the ``sizes``, the member *set* and ``align``; see the module
    docstring for the rule. Raises :class:`ConfigError` naming a bad size, member or align.
    """
    if isinstance(sizes, int):  # a bool is refused by the check
        counts: tuple[int, ...] = (_check_count("total", sizes, 0),)
    else:
        counts = tuple(sizes)
        for i, n in enumerate(counts):
            _check_count(f"sizes[{i}]", n, 0)
    order = layout_order(members)
    bounds = balanced_bounds(sum(counts), len(order), align)
    return Layout(order, tuple(bounds), counts, align)


def overlaps(old: Sequence[int], new: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Walk two boundary lists over the same total: ``(start, stop, old_i, new_j)`` for
    every non-empty run of elements inside old shard ``old_i`` and new shard ``new_j``."""
    if old[-1] != new[-1]:
        raise ConfigError(f"the layouts cover different totals: {old[-1]} and {new[-1]}")
    i = j = pos = 0
    total = old[-1]
    while pos < total:
        end = min(old[i + 1], new[j + 1])
        if end > pos:
            yield pos, end, i, j
            pos = end
        if old[i + 1] == end:
            i += 1
        if new[j + 1] == end:
            j += 1


def owner_changes(old: Layout, new: Layout) -> int:
    """Elements whose owner in ``new`` is not their owner in ``old``: the least any plan
    must deliver to new owners before replicas held locally are counted."""
    changed = 0
    for start, stop, i, j in overlaps(old.bounds, new.bounds):
        if old.members[i] != new.members[j]:
            changed += stop - start
    return changed
