"""Who sends which elements to whom when an epoch is entered: the disjoint fetch plan.

Where it sits: between a sharded job's restored snapshots and its new shards
(sharded_snapshot.py). Every member of the new epoch announces what its snapshot holds
and what it needs (the windows it will step), as ranges of the flattened state; each
member computes the same plan from the same announcements, and the data moves rank to
rank in one ``alltoall`` (not every piece to every member).

The rule
    A member fetches only what it needs and does not hold. Each such element comes from
    exactly one live holder: the state is cut at every holder's boundaries, and each
    segment goes to the holder that has sent the fewest elements so far (ties: the first
    rank after the receiver, so that equal holders take turns). After the loss of one
    node with one replica a lost segment has a single live copy, so the plan is the
    layout's (the replica's holder, who in the chunked layout is mostly its new owner and
    sends nothing); after a join or a rollback the sends spread over every holder.
    Elements that some member needs and no member holds are ``lost``: the caller reports
    a double fault; nothing is filled in.

Announcements arrive from peers, so they are checked before use (``decode``): counts
that match the length, ranges inside the state, sorted and disjoint. Torch-free.
"""

from __future__ import annotations

import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from keepstep.elastic.shard.layout import Range
from keepstep.errors import KeepstepError

__all__ = ["Announcement", "Fetches", "decode", "encode", "limit", "minus", "plan_fetches"]

_INT = struct.Struct("<q")


class BadAnnouncement(KeepstepError):
    """A peer's announcement is malformed (the caller names the peer)."""


@dataclass(frozen=True)
class Announcement:
    """What one member's restored snapshot holds and what its epoch's windows need."""

    held: tuple[Range, ...]
    need: tuple[Range, ...]


@dataclass(frozen=True)
class Fetches:
    """``sends[src][dst]``: the ranges ``src`` sends to ``dst`` (merged, sorted);
    ``lost``: needed elements that no member holds (merged, sorted)."""

    sends: tuple[tuple[tuple[Range, ...], ...], ...]
    lost: tuple[Range, ...]

    def sent(self, src: int) -> int:
        """Elements ``src`` sends in all."""
        return sum(r.size for ranges in self.sends[src] for r in ranges)

    def received(self, dst: int) -> int:
        """Elements ``dst`` receives in all."""
        return sum(r.size for row in self.sends for r in row[dst])


def limit(total: int) -> int:
    """The most bytes an announcement over ``total`` elements can need (every range
    boundary distinct, both lists)."""
    return _INT.size * (2 + 4 * (total + 1))


def encode(a: Announcement) -> bytes:
    """Little-endian int64: the count of held ranges, their bounds, then the same for need."""
    values: list[int] = [len(a.held)]
    values += [x for r in a.held for x in r]
    values.append(len(a.need))
    values += [x for r in a.need for x in r]
    return struct.pack(f"<{len(values)}q", *values)


def decode(raw: bytes, total: int) -> Announcement:
    """The announcement in ``raw``, checked; ``BadAnnouncement`` names what is off."""
    if len(raw) % _INT.size:
        raise BadAnnouncement(f"{len(raw)} bytes is not a whole number of int64 values")
    values = struct.unpack(f"<{len(raw) // _INT.size}q", raw)
    at = 0
    lists: list[tuple[Range, ...]] = []
    for name in ("held", "need"):
        if at >= len(values):
            raise BadAnnouncement(f"the {name} count is missing")
        n = values[at]
        at += 1
        if not 0 <= n <= (len(values) - at) // 2:
            raise BadAnnouncement(f"{name} count {n} does not fit the {len(values)} values")
        ranges = tuple(Range(values[at + 2 * i], values[at + 2 * i + 1]) for i in range(n))
        at += 2 * n
        previous = 0
        for r in ranges:
            if not previous <= r.start < r.stop <= total:
                raise BadAnnouncement(
                    f"{name} range [{r.start}, {r.stop}) is empty, unsorted, overlapping or "
                    f"outside the state's {total} elements"
                )
            previous = r.stop
        lists.append(ranges)
    if at != len(values):
        raise BadAnnouncement(f"{len(values) - at} values left over")
    return Announcement(*lists)


def plan_fetches(announced: Sequence[Announcement]) -> Fetches:
    """The plan for members announcing ``announced`` (rank order); see the module."""
    world = len(announced)
    # Cut the state at every holder's boundaries; each segment knows its holders.
    cuts = sorted({x for a in announced for r in a.held for x in r})
    holders: list[list[int]] = [[] for _ in range(max(len(cuts) - 1, 0))]
    for rank, a in enumerate(announced):
        for r in a.held:
            for s in range(bisect_right(cuts, r.start) - 1, bisect_right(cuts, r.stop - 1)):
                holders[s].append(rank)
    sent = [0] * world
    sends: list[list[list[Range]]] = [[[] for _ in range(world)] for _ in range(world)]
    lost: list[Range] = []
    for dst, a in enumerate(announced):
        for part in minus(a.need, a.held):
            at = part.start
            while at < part.stop:
                s = bisect_right(cuts, at) - 1
                if 0 <= s < len(holders):
                    end, there = min(part.stop, cuts[s + 1]), holders[s]
                elif s < 0 and cuts:  # before the first held element
                    end, there = min(part.stop, cuts[0]), []
                else:  # after the last one, or nothing is held anywhere
                    end, there = part.stop, []
                if not there:
                    lost.append(Range(at, end))
                else:
                    src = min(there, key=lambda h: (sent[h], (h - dst) % world))
                    sent[src] += end - at
                    row = sends[src][dst]
                    if row and row[-1].stop == at:
                        row[-1] = Range(row[-1].start, end)
                    else:
                        row.append(Range(at, end))
                at = end
    frozen = tuple(tuple(tuple(row) for row in per_src) for per_src in sends)
    return Fetches(frozen, _merge(lost))


def minus(want: Sequence[Range], have: Sequence[Range]) -> list[Range]:
    """The parts of ``want`` (sorted, disjoint) outside ``have`` (sorted, disjoint)."""
    out: list[Range] = []
    j = 0
    for r in want:
        at = r.start
        while j < len(have) and have[j].stop <= at:
            j += 1
        k = j
        while at < r.stop:
            if k < len(have) and have[k].start < r.stop:
                if have[k].start > at:
                    out.append(Range(at, have[k].start))
                at = max(at, have[k].stop)
                k += 1
            else:
                out.append(Range(at, r.stop))
                at = r.stop
    return out


def _merge(ranges: Sequence[Range]) -> tuple[Range, ...]:
    out: list[Range] = []
    for r in sorted(ranges):
        if out and r.start <= out[-1].stop:
            out[-1] = Range(out[-1].start, max(out[-1].stop, r.stop))
        elif r.stop > r.start:
            out.append(r)
    return tuple(out)
