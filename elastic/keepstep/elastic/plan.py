"""The micro-batch plan: which member computes which micro-batches of a step.

Step 1 of the happy path (see ARCHITECTURE.md). After every membership change each
member calls :func:`plan` with the same sorted member list and gets the same answer,
with no communication: the plan is a pure function. The global batch never changes,
``global_batch = micro_batch * n_micro``; only the split of the ``n_micro`` micro-batch
ids over the members does. Because sample indices and RNG streams are keyed by the
micro-batch id (see ``rng.py``), not by the member, the split does not change the numbers.

A member's block is contiguous and blocks follow member order, so the ids ascend when
read member by member; the order-invariant reduction does not need that, but logs and
tests read better, and it keeps a straggler's share in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

from keepstep.elastic.errors import ConfigError

__all__ = ["micro_batch_count", "owner_of", "plan"]


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


def _check_weights(weights: Mapping[str, float], members: list[str]) -> dict[str, Fraction]:
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights={weights!r} must be a mapping of member id -> weight")
    known = set(members)
    missing = [m for m in members if m not in weights]
    extra = sorted(repr(k) for k in weights if k not in known)
    if missing or extra:
        raise ConfigError(
            f"weights must name exactly the members: missing {missing!r}, "
            f"unknown [{', '.join(extra)}]"
        )
    exact: dict[str, Fraction] = {}
    for member in members:
        w = weights[member]
        if not isinstance(w, int | float) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"weight {w!r} of member {member!r} must be a finite number > 0")
        # Fraction(float) is exact, so every member computes the same quotas bit for bit.
        exact[member] = Fraction(w)
    return exact


def _largest_remainder(seats: int, weights: dict[str, Fraction]) -> dict[str, int]:
    """Hamilton apportionment of ``seats``; ties go to the earlier member (dict order)."""
    total = sum(weights.values(), Fraction(0))
    quotas = {m: seats * w / total for m, w in weights.items()}
    counts = {m: math.floor(q) for m, q in quotas.items()}
    left = seats - sum(counts.values())
    order = list(weights)
    # Stable sort: equal remainders keep member order.
    by_remainder = sorted(order, key=lambda m: quotas[m] - counts[m], reverse=True)
    for member in by_remainder[:left]:
        counts[member] += 1
    return counts


def _weighted_counts(n_micro: int, weights: dict[str, Fraction]) -> dict[str, int]:
    """Largest remainder with a floor of one micro-batch per member.

    A member whose quota rounds to zero is given exactly one and leaves the pool; the
    others re-share what is left by their weights, until nobody gets zero. Without any
    zero this is plain largest remainder, so every count is within one of its quota.
    """
    fixed: dict[str, int] = {}
    pool = dict(weights)
    while True:
        counts = _largest_remainder(n_micro - len(fixed), pool)
        zeros = [m for m, c in counts.items() if c == 0]
        if not zeros:
            break
        for member in zeros:
            fixed[member] = 1
            del pool[member]
        # len(members) <= n_micro keeps the pool's seats >= its size, so this ends.
    merged = {**fixed, **counts}
    return {m: merged[m] for m in weights}


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
        counts = {m: base + (1 if i < extra else 0) for i, m in enumerate(listed)}
    else:
        counts = _weighted_counts(n_micro, _check_weights(weights, listed))

    assignment: dict[str, list[int]] = {}
    start = 0
    for member in listed:
        assignment[member] = list(range(start, start + counts[member]))
        start += counts[member]

    # The batch invariant, asserted where it is made: every id once, none lost.
    assert start == n_micro, (start, n_micro)
    assert all(len(ids) >= 1 for ids in assignment.values()), counts
    assert sorted(owner_of(assignment)) == list(range(n_micro))
    return assignment


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
