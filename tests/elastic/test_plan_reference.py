"""The fast micro-batch plan against the straightforward one it replaced.

``plan`` validates members in one pass and apportions per group of equal weights, for
100,000 members. The reference below is the earlier algorithm, one member at a time; the
two must agree on every count, every tie-break and every error message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.plan import micro_batch_count, plan

FAST = settings(max_examples=300, deadline=None)


def _ref_members(members: Sequence[str]) -> list[str]:
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


def _ref_weights(weights: Mapping[str, float], members: list[str]) -> dict[str, int]:
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights={weights!r} must be a mapping of member id -> weight")
    if len(weights) != len(members) or any(m not in weights for m in members):
        known = set(members)
        missing = [m for m in members if m not in weights]
        extra = sorted(repr(k) for k in weights if k not in known)
        raise ConfigError(
            f"weights must name exactly the members: missing {missing!r}, "
            f"unknown [{', '.join(extra)}]"
        )
    ratios: list[tuple[int, int]] = []
    for member in members:
        w = weights[member]
        if not isinstance(w, int | float) or isinstance(w, bool) or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"weight {w!r} of member {member!r} must be a finite number > 0")
        ratios.append(w.as_integer_ratio())
    denominator = max(q for _, q in ratios)
    return {m: p * (denominator // q) for m, (p, q) in zip(members, ratios, strict=True)}


def _ref_largest_remainder(seats: int, weights: dict[str, int]) -> dict[str, int]:
    total = sum(weights.values())
    counts: dict[str, int] = {}
    remainders: dict[str, int] = {}
    for member, w in weights.items():
        counts[member], remainders[member] = divmod(seats * w, total)
    left = seats - sum(counts.values())
    by_remainder = sorted(weights, key=remainders.__getitem__, reverse=True)
    for member in by_remainder[:left]:
        counts[member] += 1
    return counts


def _ref_weighted_counts(n_micro: int, weights: dict[str, int]) -> dict[str, int]:
    fixed: dict[str, int] = {}
    pool = dict(weights)
    while True:
        counts = _ref_largest_remainder(n_micro - len(fixed), pool)
        zeros = [m for m, c in counts.items() if c == 0]
        if not zeros:
            break
        for member in zeros:
            fixed[member] = 1
            del pool[member]
    merged = {**fixed, **counts}
    return {m: merged[m] for m in weights}


def reference_plan(
    step: int,
    members: Sequence[str],
    global_batch: int,
    micro_batch: int,
    weights: Mapping[str, float] | None = None,
) -> dict[str, list[int]]:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step={step!r} must be an int >= 0")
    n_micro = micro_batch_count(global_batch, micro_batch)
    listed = _ref_members(members)
    if len(listed) > n_micro:
        raise ConfigError(
            f"{len(listed)} members but only {n_micro} micro-batches; at most {n_micro} "
            f"members can train with global_batch={global_batch} micro_batch={micro_batch}"
        )
    if weights is None:
        base, extra = divmod(n_micro, len(listed))
        counts = {m: base + (1 if i < extra else 0) for i, m in enumerate(listed)}
    else:
        counts = _ref_weighted_counts(n_micro, _ref_weights(weights, listed))
    assignment: dict[str, list[int]] = {}
    start = 0
    for member in listed:
        assignment[member] = list(range(start, start + counts[member]))
        start += counts[member]
    return assignment


def _outcome(fn: object, *args: object) -> object:
    assert callable(fn)
    try:
        return fn(*args)
    except (ConfigError, OverflowError) as error:
        return (type(error).__name__, str(error))


# Grid weights (most equal, as the speed policy makes them), awkward ones (1/3, ties
# across different values), tiny ones (the floor of one), ints, and bad values.
GOOD = st.one_of(
    st.sampled_from([1.0, 1.0, 1.0, 1 / 3, 2 / 3, 0.5, 2, 3, 1e-9, 1e-6]),
    st.integers(-4, 4).map(lambda k: 1.05**k),
    st.floats(1e-9, 1e3, allow_nan=False, allow_infinity=False),
    st.integers(1, 1000),
)
BAD = st.sampled_from([0, 0.0, -1.0, math.nan, math.inf, True, False, "1", None, [1.0]])


@st.composite
def jobs(draw: st.DrawFn) -> tuple[list[str], int, int, dict[str, object] | None]:
    micro_batch = draw(st.integers(1, 4))
    n_micro = draw(st.integers(1, 80))
    n_members = draw(st.integers(1, min(n_micro + 1, 40)))
    members = sorted(f"node-{i // 4}/{i % 4}" for i in range(n_members))
    weights: dict[str, object] | None = None
    if draw(st.booleans()):
        weights = {m: draw(GOOD) for m in members}
        if draw(st.integers(0, 9)) == 0:
            weights[draw(st.sampled_from(members))] = draw(BAD)
    return members, micro_batch * n_micro, micro_batch, weights


@FAST
@given(jobs())
def test_fast_plan_equals_the_reference(
    job: tuple[list[str], int, int, dict[str, object] | None],
) -> None:
    members, global_batch, micro_batch, weights = job
    fast = _outcome(plan, 0, members, global_batch, micro_batch, weights)
    assert fast == _outcome(reference_plan, 0, members, global_batch, micro_batch, weights)


@FAST
@given(
    st.lists(st.one_of(st.sampled_from(["a", "b", "c", "", "a/1"]), st.just(3)), max_size=6),
    st.booleans(),
)
def test_fast_member_checks_raise_what_the_reference_raises(
    members: list[object], weighted: bool
) -> None:
    weights = {m: 1.0 for m in members if isinstance(m, str)} if weighted else None
    args = (0, members, 64, 1, weights)
    assert _outcome(plan, *args) == _outcome(reference_plan, *args)


def test_weights_that_name_other_members_or_keys_are_refused_alike() -> None:
    members = ["a", "b", "c"]
    for weights in (
        {"a": 1.0, "b": 1.0},
        {"a": 1.0, "b": 1.0, "d": 1.0},
        {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0},
        {"a": 1, "b": True, "c": 1.0},
        {"a": 1.0, "b": 10**400, "c": -1.0},
    ):
        args = (0, members, 12, 1, weights)
        assert _outcome(plan, *args) == _outcome(reference_plan, *args)


def test_twenty_thousand_members_on_a_grid_agree() -> None:
    members = sorted(f"n{i // 8}/{i % 8}" for i in range(20_000))
    weights = {m: 1.05 ** (i % 7 - 3) if i % 5 == 0 else 1.0 for i, m in enumerate(members)}
    assert plan(0, members, 80_000, 1, weights) == reference_plan(0, members, 80_000, 1, weights)
    assert plan(0, members, 80_001, 1) == reference_plan(0, members, 80_001, 1)
