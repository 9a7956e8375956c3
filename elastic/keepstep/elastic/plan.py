"""The micro-batch plan: which member computes which micro-batches of a step.

Step 1 of the happy path (see ARCHITECTURE.md). After every membership change each
member calls :func:`plan` with the same sorted member list and gets the same answer,
with no communication: the plan is a pure function. The global batch never changes,
``global_batch = micro_batch * n_micro``; only the split of the ``n_micro`` micro-batch
ids over the members does. Because sample indices and RNG streams are keyed by the
micro-batch id (see ``rng.py``), not by the member, the split does not change the numbers.

A member's block is contiguous and blocks follow member order, so the ids ascend when
read member by member; the order-invariant reduction does not need that, but logs and
tests read better, and it keeps a straggler's share in one piece. That also makes the
plan two lists: :func:`plan_blocks` returns the sorted members and where each block stops,
which is what every member computes; a member reads its own block from it by bisection, and
:func:`plan` spells every block out (what logs, commit records and tests read), which at
100,000 members costs more than the plan itself.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, islice, repeat

from keepstep.elastic.errors import ConfigError

__all__ = ["Blocks", "micro_batch_count", "owner_of", "plan", "plan_blocks"]


def _check_positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a batch size is always a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive int")
    return value


def micro_batch_count(global_batch: int, micro_batch: int) -> int:
    """Return ``n_micro = global_batch // micro_batch``, the micro-batches per step.

    Raises :class:`ConfigError` unless both are positive ints and ``micro_batch``
    divides ``global_batch`` exactly (a remainder would change the global batch).
    """
    _check_positive_int("global_batch", global_batch)
    _check_positive_int("micro_batch", micro_batch)
    if global_batch % micro_batch != 0:
        raise ConfigError(
            f"global_batch={global_batch} is not divisible by micro_batch={micro_batch}; "
            "the global batch must be a whole number of micro-batches"
        )
    n_micro = global_batch // micro_batch
    assert n_micro * micro_batch == global_batch
    return n_micro


def _check_members(members: Sequence[str]) -> list[str]:
    # A bare string is a Sequence[str] too; iterating it would plan per character.
    if isinstance(members, str) or not isinstance(members, Sequence):
        raise ConfigError(f"members={members!r} must be a sequence of member id strings")
    listed = list(members)
    if not listed:
        raise ConfigError("members=[] is empty; at least one member must train")
    # The common case in one pass at C speed: plain strs, strictly increasing (so sorted
    # and unique), hence "" could only come first. Anything else takes the slow checks
    # below, which find the first problem in their order and name it.
    if (
        set(map(type, listed)) == {str}
        and all(map(str.__lt__, listed, islice(listed, 1, None)))
        and listed[0]
    ):
        return listed
    for member in listed:
        if not isinstance(member, str) or not member:
            raise ConfigError(f"member id {member!r} in members must be a non-empty str")
    if len(set(listed)) != len(listed):
        dupes = sorted({m for m in listed if listed.count(m) > 1})
        raise ConfigError(f"members={listed!r} has duplicate ids {dupes!r}; ids must be unique")
    if listed != sorted(listed):
        raise ConfigError(
            f"members={listed!r} is not sorted; every member must see the same order "
            f"(expected {sorted(listed)!r})"
        )
    return listed


def _ratio(member: str, w: object) -> tuple[int, int]:
    if not isinstance(w, int | float) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
        raise ConfigError(f"weight {w!r} of member {member!r} must be a finite number > 0")
    return w.as_integer_ratio()


def _check_weights(weights: Mapping[str, float], members: list[str]) -> list[int]:
    """The weights in member order as integers in exact proportion: every float is
    p / 2**k exactly, so scaling all by the largest denominator loses nothing (ints have
    denominator 1). The apportionment below then runs on ints, the same numbers a
    Fraction would give, bit for bit on every member. Weights come from a coarse grid, so
    each distinct value is checked and converted once."""
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights={weights!r} must be a mapping of member id -> weight")
    values: list[float] = []
    # With as many keys as members, every member found means exactly the members. A plain
    # dict is read in the same pass (a KeyError is a missing member); another mapping may
    # answer a missing key (defaultdict), so it is asked first.
    if len(weights) == len(members):
        if type(weights) is dict:
            with contextlib.suppress(KeyError):
                values = list(map(weights.__getitem__, members))
        elif all(map(weights.__contains__, members)):
            values = list(map(weights.__getitem__, members))
    if not values:
        known = set(members)
        missing = [m for m in members if m not in weights]
        extra = sorted(repr(k) for k in weights if k not in known)
        raise ConfigError(
            f"weights must name exactly the members: missing {missing!r}, "
            f"unknown [{', '.join(extra)}]"
        )
    # Checked per distinct value only when every weight is a plain int or float: then
    # equal keys (1 and 1.0) are equally valid with equal ratios, which True and 1 are not.
    valid = False
    if set(map(type, values)) <= {int, float}:
        distinct = dict.fromkeys(values)
        valid = all(math.isfinite(w) and w > 0 for w in distinct)
    if not valid:
        for member, w in zip(members, values, strict=True):
            _ratio(member, w)  # raises at the first bad weight, naming its member
        distinct = dict.fromkeys(values)
    ratios = {w: w.as_integer_ratio() for w in distinct}
    # Denominators are powers of two, so the largest is a multiple of every other.
    denominator = max(q for _, q in ratios.values())
    scaled = {w: p * (denominator // q) for w, (p, q) in ratios.items()}
    return list(map(scaled.__getitem__, values))


def _extra_seats(
    left: int, pool: dict[int, list[int]], remainders: dict[int, int]
) -> dict[int, int]:
    """How many members of each weight's group get one of the ``left`` extra seats.

    Largest remainders first; members of one group share a remainder, so within a run
    of equal remainders the seats go to the lowest indices across the run's groups: a
    prefix of each group's ascending indices."""
    extra = dict.fromkeys(pool, 0)
    runs: dict[int, list[int]] = {}
    for w, r in remainders.items():
        runs.setdefault(r, []).append(w)
    for r in sorted(runs, reverse=True):
        if left == 0:
            break
        tied = runs[r]
        size = sum(len(pool[w]) for w in tied)
        if size <= left:
            for w in tied:
                extra[w] = len(pool[w])
            left -= size
            continue
        if len(tied) == 1:
            extra[tied[0]] = left
            break
        # The left-th lowest index of the run (sorting ascending runs merges them).
        last = sorted(chain.from_iterable(pool[w] for w in tied))[left - 1]
        for w in tied:
            extra[w] = bisect.bisect_right(pool[w], last)
        left = 0
    return extra


def _weighted_counts(n_micro: int, weights: list[int]) -> list[int]:
    """Largest remainder with a floor of one micro-batch per member, ties to the earlier
    member (Hamilton apportionment, run per group of equal weights).

    A member whose quota rounds to zero is given exactly one and leaves the pool; the
    others re-share what is left by their weights, until nobody gets zero. Without any
    zero this is plain largest remainder, so every count is within one of its quota.
    Member m's quota is ``seats * w / total``: its floor and remainder are the quotient
    and remainder of one integer division, and remainders over one total compare as
    their numerators do.
    """
    fixed: list[int] = []  # members given exactly one
    pool: dict[int, list[int]] = {}
    for i, w in enumerate(weights):
        pool.setdefault(w, []).append(i)
    seats = n_micro
    while True:
        total = sum(w * len(ids) for w, ids in pool.items())
        split = {w: divmod(seats * w, total) for w in pool}
        left = seats - sum(q * len(pool[w]) for w, (q, _) in split.items())
        extra = _extra_seats(left, pool, {w: r for w, (_, r) in split.items()})
        zeros = {w: ids[extra[w] :] for w, ids in pool.items() if split[w][0] == 0}
        if not any(zeros.values()):
            break
        for w, lost in zeros.items():
            seats -= len(lost)
            fixed += lost
            pool[w] = pool[w][: extra[w]]
            if not pool[w]:
                del pool[w]
        # len(members) <= n_micro keeps the pool's seats >= its size, so this ends.
    # A whole group's count by one lookup per member; then the few exceptions: the first
    # members of a group cut inside a run of equal remainders, and those fixed at one.
    count_of = {w: q + (extra[w] == len(pool[w])) for w, (q, _) in split.items()}
    counts = list(map(count_of.get, weights, repeat(1)))
    for w, ids in pool.items():
        if 0 < extra[w] < len(ids):
            for i in ids[: extra[w]]:
                counts[i] += 1
    for i in fixed:
        counts[i] = 1
    return counts


@dataclass(frozen=True)
class Blocks:
    """A plan in compact form: ``members[i]`` computes the ids from ``stops[i - 1]`` (0 for
    the first) up to ``stops[i]``, excluded. ``members`` is sorted, so a block is found by
    bisection without building a dict of every member."""

    members: Sequence[str]
    stops: Sequence[int]

    def _index(self, member: str) -> int:
        i = bisect.bisect_left(self.members, member)
        if i == len(self.members) or self.members[i] != member:
            count = len(self.members)
            raise ConfigError(f"member {member!r} is not in this plan's {count} members")
        return i

    def of(self, member: str) -> range:
        """The micro-batch ids of ``member``'s block (ConfigError if it has none)."""
        i = self._index(member)
        return range(self.stops[i - 1] if i else 0, self.stops[i])

    def count(self, member: str) -> int:
        """How many micro-batches ``member`` computes."""
        return len(self.of(member))

    def as_dict(self) -> dict[str, list[int]]:
        """Every member's block spelled out, in member order (what :func:`plan` returns)."""
        # Slices of one list of ids share its int objects: cheaper than a list per range.
        ids = list(range(self.stops[-1]))
        blocks = map(ids.__getitem__, map(slice, [0, *self.stops[:-1]], self.stops))
        return dict(zip(self.members, blocks, strict=True))


def plan_blocks(
    step: int,
    members: Sequence[str],
    global_batch: int,
    micro_batch: int,
    weights: Mapping[str, float] | None = None,
) -> Blocks:
    """The plan of :func:`plan` (same arguments, same checks) as :class:`Blocks`."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step={step!r} must be an int >= 0")
    n_micro = micro_batch_count(global_batch, micro_batch)
    listed = _check_members(members)
    if len(listed) > n_micro:
        raise ConfigError(
            f"{len(listed)} members but only {n_micro} micro-batches; at most {n_micro} "
            f"members can train with global_batch={global_batch} micro_batch={micro_batch}"
        )

    if weights is None:
        base, extra = divmod(n_micro, len(listed))
        # Equal blocks: the stops are two arithmetic runs, built at C speed.
        stops = list(range(base + 1, (base + 1) * extra + 1, base + 1))
        stops += range(stops[-1] + base if stops else base, n_micro + 1, base)
        counts_min = base  # extra < len(listed), so some block has base ids
    else:
        counts = _weighted_counts(n_micro, _check_weights(weights, listed))
        stops = list(accumulate(counts))
        counts_min = min(counts)

    # The batch invariant, asserted where it is made: blocks of at least one id that
    # follow each other from 0 without a gap or an overlap cover every id once.
    assert counts_min >= 1, counts_min
    assert len(stops) == len(listed), (len(stops), len(listed))
    assert stops[-1] == n_micro, (stops[-1], n_micro)
    return Blocks(listed, stops)


def plan(
    step: int,
    members: Sequence[str],
    global_batch: int,
    micro_batch: int,
    weights: Mapping[str, float] | None = None,
) -> dict[str, list[int]]:
    """Assign the micro-batch ids ``0..n_micro-1`` of ``step`` to ``members``.

    ``members`` must be non-empty, unique, sorted, and at most ``n_micro`` long. Each
    member gets a contiguous ascending block, blocks in member order, every id exactly
    once. Without ``weights`` the counts differ by at most one and the first
    ``n_micro % len(members)`` members get the extra one. With ``weights`` (finite,
    > 0, one per member) the counts are apportioned by the largest-remainder method,
    ties broken by member order, with at least one micro-batch per member.

    The result does not depend on ``step`` today; the parameter is part of the contract
    so that a later version may rotate blocks between steps without changing callers.
    """
    return plan_blocks(step, members, global_batch, micro_batch, weights).as_dict()


def owner_of(assignment: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """Invert a plan: micro-batch id -> member.

    Raises :class:`ConfigError` unless the ids are exactly ``0..n-1``, each owned once.
    """
    owners: dict[int, str] = {}
    for member, ids in assignment.items():
        for mb in ids:
            if not isinstance(mb, int) or isinstance(mb, bool) or mb < 0:
                raise ConfigError(f"micro-batch id {mb!r} of member {member!r} must be int >= 0")
            if mb in owners:
                raise ConfigError(
                    f"micro-batch {mb} is assigned twice: to {owners[mb]!r} and {member!r}"
                )
            owners[mb] = member
    missing = sorted(set(range(len(owners))) - owners.keys())
    if missing:
        raise ConfigError(
            f"micro-batch ids {missing!r} have no owner; ids must be 0..{len(owners) - 1}"
        )
    return dict(sorted(owners.items()))
