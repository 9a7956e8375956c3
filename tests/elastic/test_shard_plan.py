"""Tests of keepstep.elastic.shard.plan: the moves from one membership's shards to the next.

Tables pin small cases (loss, join, drain, double fault); hypothesis checks, for 2..64
members over 2..16 nodes and random tensor sizes, that after any single-node loss the
plan leaves every element with its owner and replicas, from live holders only, moves
nothing a destination already holds, and keeps every member within the documented send
and receive bounds. Bytes moved against the lost shards are pinned by a closed form.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.shard import (
    Move,
    Placement,
    Plan,
    Range,
    ShardLost,
    make_layout,
    node_of,
    owner_changes,
    place_replicas,
    plan_transfers,
)
from keepstep.errors import ConfigError

FAST = settings(max_examples=120, deadline=None)


def grid(nodes: int, per_node: int) -> list[str]:
    return [f"n{n}/{w}" for n in range(nodes) for w in range(per_node)]


def placed(sizes: list[int] | int, members: list[str], replicas: int = 1) -> Placement:
    return place_replicas(make_layout(sizes, members), replicas)


def after(old: Placement, members: list[str], live: list[str] | None = None) -> Plan:
    """The plan to ``members``, with as many replicas as their nodes allow."""
    nodes = len({node_of(m) for m in members})
    new = placed(list(old.layout.sizes), members, min(old.replicas, nodes - 1))
    return plan_transfers(old, new, members if live is None else live)


def without_node(members: list[str], node: str) -> list[str]:
    return [m for m in members if node_of(m) != node]


# --- tables -----------------------------------------------------------------------------


def test_node_loss_table() -> None:
    old = placed([10, 7, 3], grid(3, 2))  # n0/0 n1/0 n2/0 n0/1 n1/1 n2/1; 0 3 6 10 13 16 20
    plan = after(old, without_node(grid(3, 2), "n1"))  # n0/0 n2/0 n0/1 n2/1; 0 5 10 15 20
    assert plan.moves == (
        Move("n0/0", "n2/0", 0, 3, 1),  # n2/0 now keeps n0/0's copy
        Move("n2/0", "n0/0", 3, 5, 0),  # n0/0 grows right into n1/0's lost shard
        Move("n2/0", "n0/1", 5, 6, 1),
        Move("n0/1", "n2/1", 10, 13, 1),
        Move("n2/1", "n0/1", 13, 15, 0),
        Move("n2/1", "n0/0", 15, 16, 1),
    )
    plan.verify()
    # n2/0 and n2/1 take over leftwards from the copies they kept: no move for that.
    assert plan.lost_elements == 6
    assert plan.elements(owners=True) == 4 and plan.elements(owners=False) == 8
    assert plan.sent() == Counter({"n2/0": 3, "n0/1": 3, "n0/0": 3, "n2/1": 3})
    assert plan.sends("n2/0") == [Move("n2/0", "n0/0", 3, 5, 0), Move("n2/0", "n0/1", 5, 6, 1)]
    assert plan.receives("n2/1") == [Move("n0/1", "n2/1", 10, 13, 1)]


def test_no_change_moves_nothing() -> None:
    old = placed(1000, grid(4, 2), 2)
    assert len(after(old, grid(4, 2))) == 0


def test_join_only_receives() -> None:
    old = placed([300, 100], grid(3, 2))
    members = grid(4, 2)  # n3 joins
    plan = after(old, members, live=grid(3, 2))
    plan.verify()
    assert plan.lost_elements == 0
    new = plan.new
    for joiner in ("n3/0", "n3/1"):
        assert not plan.sends(joiner)
        need = new.layout.shard(joiner).size
        need += sum(new.layout.shard(o).size for o in new.kept_by(joiner))
        assert plan.received()[joiner] == need  # it held nothing before


def test_drain_sends_before_leaving() -> None:
    old = placed(600, grid(3, 2))
    leaving = "n2/1"
    plan = after(old, [m for m in grid(3, 2) if m != leaving], live=grid(3, 2))
    plan.verify()
    assert plan.lost_elements == 0
    assert plan.sent()[leaving] > 0 and not plan.receives(leaving)


def test_double_fault_raises_shard_lost_naming_range_and_holders() -> None:
    old = placed(60, grid(3, 2))  # n0/0 owns [0, 10), n1/0 keeps its copy
    survivors = [m for m in grid(3, 2) if m not in ("n0/0", "n1/0")]
    with pytest.raises(ShardLost) as caught:
        after(old, survivors)
    assert caught.value.ranges == (Range(0, 10),)
    assert caught.value.members == ("n0/0", "n1/0")
    assert str(caught.value).startswith(
        "10 elements have no live copy: [0, 10) were held only by n0/0, n1/0, none of them live"
    )


def test_two_copies_survive_two_lost_nodes_of_three() -> None:
    old = placed(90, grid(3, 3), 2)  # every shard has a copy on every node
    plan = after(old, grid(3, 3)[:3])  # only n0 is left
    plan.verify()
    # n0/0 keeps [0, 10) and the copies of the two shards left of it (wrapping round):
    # of its new [0, 30) it fetches [10, 30).
    assert plan.new.replicas == 0 and plan.received()["n0/0"] == 20


def test_shard_lost_merges_adjacent_ranges() -> None:
    old = placed(40, grid(2, 2), 0)  # n0/0 n1/0 n0/1 n1/1
    with pytest.raises(ShardLost) as caught:
        after(old, ["n0/1", "n1/1"])
    assert caught.value.ranges == (Range(0, 20),)
    assert caught.value.members == ("n0/0", "n1/0")


def test_no_replicas_loses_state_on_any_loss() -> None:
    old = placed(40, grid(2, 2), 0)
    with pytest.raises(ShardLost, match=r"10 elements .* \[10, 20\) were held only by n1/0"):
        after(old, [m for m in grid(2, 2) if m != "n1/0"])


def test_plan_errors_name_the_values() -> None:
    old = placed(40, grid(2, 2))
    with pytest.raises(ConfigError, match="the old layout shards 1 tensors, 40 elements; the new"):
        plan_transfers(old, placed(41, grid(2, 2)), grid(2, 2))
    with pytest.raises(ConfigError, match=r"live=\['n9/0'\] are not members of the old layout"):
        plan_transfers(old, old, [*grid(2, 2), "n9/0"])


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("per_node", [1, 3])
def test_bytes_moved_against_the_lost_shards(nodes: int, per_node: int) -> None:
    # Node c of K (equal nodes, R = 1): the new owners left of c in each round fetch from
    # their right, the others already keep what they take over, so owner bytes are
    # c(c+1) / (2(K-1)) x the lost shards: 0 for the first node, within 1.1x for c <= 1
    # (and K >= 3), K/2 for the last. Exact balance (see layout) forces the rest.
    members = grid(nodes, per_node)
    total = 10_080 * nodes * (nodes - 1) * per_node  # divisible: no rounding
    old = placed(total, members)
    for c in range(nodes):
        plan = after(old, without_node(members, f"n{c}"))
        plan.verify()
        lost = plan.lost_elements
        assert lost == total // nodes
        if nodes == 2 and per_node == 1:  # one round: n0/0 itself keeps n1/0's copy
            assert plan.elements(owners=True) == 0
            continue
        assert plan.elements(owners=True) * 2 * (nodes - 1) == c * (c + 1) * lost
        if c == 0 or (c == 1 and nodes >= 3):
            assert plan.elements(owners=True) <= 1.1 * lost


# --- properties -------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> list[str]:
    """2..64 members over 2..16 nodes; local ids sometimes have gaps (lost workers)."""
    n_nodes = draw(st.integers(2, 16))
    total = draw(st.integers(n_nodes, 64))
    counts = [1] * n_nodes
    for _ in range(total - n_nodes):
        counts[draw(st.integers(0, n_nodes - 1))] += 1
    gaps = draw(st.booleans())
    members = []
    for n, count in enumerate(counts):
        ids: list[int] = list(range(count))
        if gaps:
            ids = sorted(draw(st.sets(st.integers(0, 80), min_size=count, max_size=count)))
        members += [f"n{n}/{w}" for w in ids]
    return members


sizes_st = st.lists(st.integers(0, 5000), min_size=1, max_size=12)


def _held(placement: Placement, live: frozenset[str]) -> dict[str, list[tuple[int, int]]]:
    held: dict[str, list[tuple[int, int]]] = {}
    layout = placement.layout
    for owner, keepers, a, b in zip(
        layout.members, placement.holders, layout.bounds, layout.bounds[1:], strict=False
    ):
        for h in (owner, *keepers):
            if h in live:
                held.setdefault(h, []).append((a, b))
    return held


def _lacking(need: tuple[int, int], have: list[tuple[int, int]]) -> int:
    a, b = need
    return (b - a) - sum(max(0, min(b, y) - max(a, x)) for x, y in have)


def check_bounds(plan: Plan) -> None:
    """The bounds plan.py documents, computed independently of its sweep."""
    old, new, live = plan.old, plan.new, plan.live
    held = _held(old, live)
    # Receive: exactly what each destination lacks of what it must hold afterwards.
    lacking: Counter[str] = Counter()
    lay = new.layout
    for owner, keepers, a, b in zip(
        lay.members, new.holders, lay.bounds, lay.bounds[1:], strict=False
    ):
        for d in (owner, *keepers):
            lacking[d] += _lacking((a, b), held.get(d, []))
    assert plan.received() == +lacking
    # Send: per old shard it holds, once per new copy slot whose scan stops at it.
    limit: Counter[str] = Counter()
    lay = old.layout
    n_old = old.replicas + 1
    for owner, keepers, a, b in zip(
        lay.members, old.holders, lay.bounds, lay.bounds[1:], strict=False
    ):
        copies = (owner, *keepers)
        for k in range(new.replicas + 1):
            for t in range(n_old):
                h = copies[(k + t) % n_old]
                if h in live:
                    limit[h] += b - a
                    break
    sent = plan.sent()
    assert all(sent[m] <= limit[m] for m in sent)
    for m in plan.moves:
        assert m.src in live and m.size > 0


@FAST
@given(clusters(), sizes_st, st.integers(1, 3), st.data())
def test_any_single_node_loss_is_restored_within_bounds(
    members: list[str], sizes: list[int], replicas: int, data: st.DataObject
) -> None:
    nodes = sorted({node_of(m) for m in members})
    replicas = min(replicas, len(nodes) - 1)
    old = placed(sizes, members, replicas)
    node = data.draw(st.sampled_from(nodes), label="lost node")
    plan = after(old, without_node(members, node))
    plan.verify()
    check_bounds(plan)
    # Replicas kept next door serve part of the takeover: owners never fetch more than
    # the owner changes the layout forces.
    assert plan.elements(owners=True) <= owner_changes(old.layout, plan.new.layout)
    if plan.new.replicas == old.replicas == 1:  # the corollary in plan.py
        held = _held(old, plan.live)
        sent = plan.sent()
        assert all(sent[m] <= 2 * sum(b - a for a, b in held[m]) for m in sent)


@FAST
@given(clusters(), sizes_st, st.integers(0, 3), st.data())
def test_any_change_is_either_planned_or_reported_lost(
    members: list[str], sizes: list[int], replicas: int, data: st.DataObject
) -> None:
    # Losses anywhere (several nodes too), joiners and drains: a plan exists exactly when
    # every non-empty old shard keeps a live holder, and then it is complete.
    nodes = sorted({node_of(m) for m in members})
    replicas = min(replicas, len(nodes) - 1)
    old = placed(sizes, members, replicas)
    dead = data.draw(st.sets(st.sampled_from(members), max_size=len(members) - 1), label="dead")
    draining = data.draw(st.sets(st.sampled_from(members)), label="draining") - dead
    joiners = [f"j{i}/0" for i in range(data.draw(st.integers(0, 3), label="joiners"))]
    live = [m for m in members if m not in dead]
    new_members = [m for m in live if m not in draining] + joiners
    if not new_members:
        return
    layout = old.layout
    lost = [
        layout.shard_at(i)
        for i, (owner, keepers) in enumerate(zip(layout.members, old.holders, strict=True))
        if layout.shard_at(i).size > 0 and all(h in dead for h in (owner, *keepers))
    ]
    new_nodes = len({node_of(m) for m in new_members})
    new = placed(sizes, new_members, min(replicas, new_nodes - 1))
    if lost:
        with pytest.raises(ShardLost) as caught:
            plan_transfers(old, new, live)
        assert sum(r.size for r in caught.value.ranges) == sum(r.size for r in lost)
        assert set(caught.value.members) <= dead
    else:
        plan = plan_transfers(old, new, live)
        plan.verify()
        check_bounds(plan)
