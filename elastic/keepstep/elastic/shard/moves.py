"""What a transfer plan is: moves between members, and the state it could not save.

Where it sits: the result types of ``plan`` (contiguous shards) and ``copies`` (chunked
layouts). Both placements describe what each member holds the same way (``holdings``),
so one :class:`Plan` serves both, and ``Plan.verify`` replays either.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, NamedTuple, Protocol, TypeVar

from keepstep.elastic.shard.layout import Range
from keepstep.errors import KeepstepError

__all__ = ["Copies", "Move", "Plan", "ShardLost"]

_SHOWN = 6  # ranges and members named in an error message before "... and N more"


class ShardLost(KeepstepError):
    """A shard and every copy of it are gone (a double fault): no plan can restore it.

    ``ranges`` are the lost elements (merged), ``members`` everyone that held them. The
    caller falls back to the newest durable checkpoint; it must never train on.
    """

    def __init__(self, ranges: Sequence[Range], members: Sequence[str]) -> None:
        merged: list[Range] = []
        for r in sorted(ranges):
            if merged and merged[-1].stop >= r.start:
                merged[-1] = Range(merged[-1].start, max(merged[-1].stop, r.stop))
            elif r.size > 0:
                merged.append(r)
        self.ranges = tuple(merged)
        self.members = tuple(dict.fromkeys(members))  # unique, first-seen order
        elements = sum(r.size for r in self.ranges)
        shown = ", ".join(f"[{a}, {b})" for a, b in self.ranges[:_SHOWN])
        if len(self.ranges) > _SHOWN:
            shown += f" and {len(self.ranges) - _SHOWN} more"
        who = ", ".join(self.members[:_SHOWN])
        if len(self.members) > _SHOWN:
            who += f" and {len(self.members) - _SHOWN} more"
        super().__init__(
            f"{elements} elements have no live copy: {shown} were held only by {who}, none "
            "of them live; resume from the newest durable checkpoint"
        )


class Copies(Protocol):
    """A placement: who holds which elements, as owner (copy 0) or replica (copy k)."""

    @property
    def replicas(self) -> int: ...

    def holdings(self) -> Iterator[tuple[str, int, int, int]]:
        """``(member, start, stop, copy)`` for every non-empty range a member holds."""
        ...

    def lost(self, live: Collection[str]) -> int:
        """Elements whose owner is not in ``live``."""
        ...


P = TypeVar("P", bound=Copies)


class Move(NamedTuple):
    """``src`` sends elements ``[start, stop)`` to ``dst``, which keeps them as its copy
    ``copy`` of that range: 0 means as owner, k >= 1 as the k-th replica."""

    src: str
    dst: str
    start: int
    stop: int
    copy: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan(Generic[P]):
    """The moves from ``old`` (with ``live`` holders) to ``new``, and figures about them.

    Stored as columns (move i is ``src[i] -> dst[i]``, elements ``[start[i], stop[i])``,
    kept as copy ``copy[i]``): plain strings and ints cost the garbage collector nothing,
    which matters at 100,000 members. ``moves`` builds :class:`Move` rows on first use.
    """

    old: P
    new: P
    live: frozenset[str]
    src: tuple[str, ...]
    dst: tuple[str, ...]
    start: tuple[int, ...]
    stop: tuple[int, ...]
    copy: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.src)

    @cached_property
    def moves(self) -> tuple[Move, ...]:
        return tuple(map(Move, self.src, self.dst, self.start, self.stop, self.copy))

    def sends(self, member: str) -> list[Move]:
        """The moves ``member`` sends, in plan order."""
        return [m for m in self.moves if m.src == member]

    def receives(self, member: str) -> list[Move]:
        """The moves ``member`` receives, in plan order."""
        return [m for m in self.moves if m.dst == member]

    def sent(self) -> Counter[str]:
        """Elements each member sends."""
        out: Counter[str] = Counter()
        for who, a, b in zip(self.src, self.start, self.stop, strict=True):
            out[who] += b - a
        return out

    def received(self) -> Counter[str]:
        """Elements each member receives."""
        out: Counter[str] = Counter()
        for who, a, b in zip(self.dst, self.start, self.stop, strict=True):
            out[who] += b - a
        return out

    def elements(self, *, owners: bool | None = None) -> int:
        """Elements moved: all, only to new owners (``owners=True``) or only to replicas."""
        return sum(
            b - a
            for a, b, k in zip(self.start, self.stop, self.copy, strict=True)
            if owners is None or owners == (k == 0)
        )

    @property
    def lost_elements(self) -> int:
        """Elements whose old owner is not live: the ideal a recovery has to move."""
        return self.old.lost(self.live)

    def verify(self) -> None:
        """Check the plan's promise by replaying it; raise AssertionError if it fails.

        Afterwards every new owner and replica keeper holds its ranges, each from live
        holders only. Costs O(moves log moves); for tests and debugging, not the hot path.
        """
        held: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for who, a, b, _ in self.old.holdings():
            if who in self.live:
                held[who].append((a, b))
        before = {who: _Cover(rs) for who, rs in held.items()}
        nothing = _Cover([])
        for m in self.moves:  # explicit raises: python -O must not skip the check
            if not before.get(m.src, nothing).covers(m.start, m.stop):
                raise AssertionError(f"{m}: the sender is not a live holder of that range")
        for m in self.moves:
            held[m.dst].append((m.start, m.stop))
        after = {who: _Cover(rs) for who, rs in held.items()}
        for who, a, b, _ in self.new.holdings():
            if not after.get(who, nothing).covers(a, b):
                raise AssertionError(f"{who} lacks part of [{a}, {b}) after the plan")


class _Cover:
    """Ranges merged where they touch, to ask whether they cover ``[start, stop)``."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        for a, b in sorted(ranges):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            elif b > a:
                merged.append((a, b))
        self.starts = [a for a, _ in merged]
        self.stops = [b for _, b in merged]

    def covers(self, start: int, stop: int) -> bool:
        i = bisect_right(self.starts, start) - 1
        return start >= stop or (i >= 0 and self.stops[i] >= stop)
