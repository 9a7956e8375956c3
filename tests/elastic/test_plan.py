"""Tests of keepstep.elastic.plan: the micro-batch plan is a pure, exact apportionment."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.plan import micro_batch_count, owner_of, plan, plan_blocks

# The machine is small and shared: no per-example deadline, a modest example count.
FAST = settings(max_examples=150, deadline=None)


@st.composite
def jobs(draw: st.DrawFn, weighted: bool) -> tuple[list[str], int, int, dict[str, float] | None]:
    micro_batch = draw(st.integers(1, 8))
    n_micro = draw(st.integers(1, 64))
    n_members = draw(st.integers(1, n_micro))
    # Two-level ids like "node-3/1"; sorted as strings, which is what callers must pass.
    members = sorted(f"node-{i // 4}/{i % 4}" for i in range(n_members))
    weights = None
    if weighted:
        weights = {
            m: draw(st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False)) for m in members
        }
    return members, micro_batch * n_micro, micro_batch, weights


def _counts(assignment: dict[str, list[int]]) -> list[int]:
    return [len(ids) for ids in assignment.values()]


@FAST
@given(jobs(weighted=False), st.integers(0, 10**9))
def test_unweighted_exactly_once_contiguous_balanced(
    job: tuple[list[str], int, int, None], step: int
) -> None:
    members, global_batch, micro_batch, _ = job
    n_micro = global_batch // micro_batch
    out = plan(step, members, global_batch, micro_batch)

    assert list(out) == members
    assert [i for m in members for i in out[m]] == list(range(n_micro))
    assert owner_of(out) == {i: m for m in members for i in out[m]}
    counts = _counts(out)
    assert sum(counts) == n_micro
    assert max(counts) - min(counts) <= 1
    extra = n_micro % len(members)
    assert counts == [
        n_micro // len(members) + (1 if k < extra else 0) for k in range(len(members))
    ]


@FAST
@given(jobs(weighted=True), st.integers(0, 10**9))
def test_weighted_exactly_once_min_one_and_proportional(
    job: tuple[list[str], int, int, dict[str, float]], step: int
) -> None:
    members, global_batch, micro_batch, weights = job
    n_micro = global_batch // micro_batch
    out = plan(step, members, global_batch, micro_batch, weights)

    assert list(out) == members
    assert [i for m in members for i in out[m]] == list(range(n_micro))
    owner_of(out)
    total = sum(Fraction(w) for w in weights.values())
    quota = {m: n_micro * Fraction(weights[m]) / total for m in members}
    for m in members:
        count = len(out[m])
        assert count >= 1
        # Never more than one above the exact quota (the floor of one only takes away).
        assert count < quota[m] + 1
    if all(q >= 1 for q in quota.values()):
        # The floor of one cannot bind: plain largest remainder, within one of each quota.
        for m in members:
            assert abs(len(out[m]) - quota[m]) < 1
            assert len(out[m]) in (math.floor(quota[m]), math.ceil(quota[m]))
    # A heavier member never gets fewer micro-batches than a lighter one.
    for a in members:
        for b in members:
            if weights[a] > weights[b]:
                assert len(out[a]) >= len(out[b])


@FAST
@given(jobs(weighted=True), st.integers(0, 10**9), st.integers(0, 10**9))
def test_deterministic_and_independent_of_step(
    job: tuple[list[str], int, int, dict[str, float]], step_a: int, step_b: int
) -> None:
    members, global_batch, micro_batch, weights = job
    assert plan(step_a, members, global_batch, micro_batch, weights) == plan(
        step_a, list(members), global_batch, micro_batch, dict(weights)
    )
    assert plan(step_a, members, global_batch, micro_batch, weights) == plan(
        step_b, members, global_batch, micro_batch, weights
    )
    assert plan(step_a, members, global_batch, micro_batch) == plan(
        step_b, tuple(members), global_batch, micro_batch
    )


@FAST
@given(st.booleans().flatmap(jobs), st.integers(0, 10**9))
def test_blocks_are_the_plan_and_each_member_finds_its_own(
    job: tuple[list[str], int, int, dict[str, float] | None], step: int
) -> None:
    members, global_batch, micro_batch, weights = job
    blocks = plan_blocks(step, members, global_batch, micro_batch, weights)
    spelled = plan(step, members, global_batch, micro_batch, weights)
    assert blocks.as_dict() == spelled
    for m in members:
        assert list(blocks.of(m)) == spelled[m]
        assert blocks.count(m) == len(spelled[m])
    for stranger in ("", "node-99/9", members[0] + "x"):
        with pytest.raises(ConfigError, match=r"is not in this plan's \d+ members"):
            blocks.of(stranger)


def test_equal_weights_match_unweighted() -> None:
    members = ["a", "b", "c"]
    assert plan(0, members, 40, 4, {"a": 2.0, "b": 2.0, "c": 2.0}) == plan(0, members, 40, 4)
    assert _counts(plan(0, members, 40, 4)) == [4, 3, 3]


def test_weighted_examples() -> None:
    # Quotas 7.5, 2.5: equal remainders, the earlier member wins the tie.
    assert _counts(plan(0, ["a", "b"], 10, 1, {"a": 3.0, "b": 1.0})) == [8, 2]
    assert _counts(plan(0, ["a", "b"], 10, 1, {"a": 1.0, "b": 3.0})) == [3, 7]
    # A straggler at a tenth of the speed keeps exactly its share.
    assert _counts(plan(0, ["a", "b"], 10, 1, {"a": 9.0, "b": 1.0})) == [9, 1]
    # Quotas ~0.03, ~0.03, ~2.94: the floor of one binds and the heavy member yields.
    assert plan(5, ["a", "b", "c"], 6, 2, {"a": 1.0, "b": 1.0, "c": 100.0}) == {
        "a": [0],
        "b": [1],
        "c": [2],
    }
    # Quotas 0.4, 4.8, 4.8: "a" is lifted to one, the others re-share nine.
    assert _counts(plan(0, ["a", "b", "c"], 10, 1, {"a": 1.0, "b": 12.0, "c": 12.0})) == [1, 5, 4]


def test_one_member_takes_all() -> None:
    assert plan(3, ["only"], 12, 4) == {"only": [0, 1, 2]}
    assert plan(3, ["only"], 12, 4, {"only": 0.5}) == {"only": [0, 1, 2]}


def test_micro_batch_count() -> None:
    assert micro_batch_count(256, 8) == 32
    assert micro_batch_count(8, 8) == 1
    with pytest.raises(ConfigError, match=r"global_batch=250 is not divisible by micro_batch=8"):
        micro_batch_count(250, 8)
    with pytest.raises(ConfigError, match=r"global_batch=0 must be a positive int"):
        micro_batch_count(0, 8)
    with pytest.raises(ConfigError, match=r"micro_batch=-2 must be a positive int"):
        micro_batch_count(8, -2)
    with pytest.raises(ConfigError, match=r"micro_batch=True must be a positive int"):
        micro_batch_count(8, True)
    with pytest.raises(ConfigError, match=r"global_batch=8\.0 must be a positive int"):
        micro_batch_count(8.0, 2)  # type: ignore[arg-type]


def test_too_many_members() -> None:
    with pytest.raises(
        ConfigError,
        match=r"4 members but only 3 micro-batches; at most 3 members can train with "
        r"global_batch=24 micro_batch=8",
    ):
        plan(0, ["a", "b", "c", "d"], 24, 8)


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([], r"members=\[\] is empty"),
        (["b", "a"], r"members=\['b', 'a'\] is not sorted"),
        (["a", "a", "b"], r"duplicate ids \['a'\]"),
        (["a", ""], r"member id '' in members must be a non-empty str"),
        (["a", 3], r"member id 3 in members must be a non-empty str"),
        ("ab", r"members='ab' must be a sequence of member id strings"),
    ],
)
def test_bad_members(members: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(0, members, 16, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("step", "match"),
    [(-1, r"step=-1 must be an int >= 0"), (1.0, r"step=1\.0 must be an int >= 0")],
)
def test_bad_step(step: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(step, ["a"], 16, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"a": 1.0}, r"missing \['b'\], unknown \[\]"),
        ({"a": 1.0, "b": 1.0, "z": 1.0}, r"missing \[\], unknown \['z'\]"),
        ({"a": 1.0, "b": 0.0}, r"weight 0\.0 of member 'b' must be a finite number > 0"),
        ({"a": -1.0, "b": 1.0}, r"weight -1\.0 of member 'a'"),
        ({"a": float("nan"), "b": 1.0}, r"weight nan of member 'a'"),
        ({"a": float("inf"), "b": 1.0}, r"weight inf of member 'a'"),
        ({"a": "1", "b": 1.0}, r"weight '1' of member 'a'"),
        ([("a", 1.0)], r"weights=\[\('a', 1\.0\)\] must be a mapping"),
    ],
)
def test_bad_weights(weights: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(0, ["a", "b"], 16, 2, weights)  # type: ignore[arg-type]


def test_owner_of_checks_exactly_once() -> None:
    assert owner_of({"a": [0, 1], "b": [2]}) == {0: "a", 1: "a", 2: "b"}
    assert owner_of({"b": [2, 0], "a": [1]}) == {0: "b", 1: "a", 2: "b"}
    with pytest.raises(ConfigError, match=r"micro-batch 1 is assigned twice: to 'a' and 'b'"):
        owner_of({"a": [0, 1], "b": [1, 2]})
    with pytest.raises(ConfigError, match=r"micro-batch ids \[1\] have no owner"):
        owner_of({"a": [0], "b": [2]})
    with pytest.raises(ConfigError, match=r"micro-batch id -1 of member 'a'"):
        owner_of({"a": [-1]})
