"""Tests of the chunked layout (keepstep.elastic.shard chunks/ring/assign/copies).

Tables pin small cases and the hashing (a change to it would move every job's state);
hypothesis checks, for 2..64 members on 1..16 nodes and random tensor sizes: every element
owned exactly once; balance within 10% at realistic sizes; after any single-node loss the
lost chunks' new owners already hold them (unless the load bound sent one on), owners
fetch at most 10% of the lost bytes (test_shard_chunks_loss.py, with the replicas' bounds);
a join takes about its share; derived layouts equal fresh ones; the member order given
does not matter; any change is planned, or reported lost exactly when some element has no
live holder.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shard_layout import clusters, grid  # the same member sets as the layout's tests

from keepstep.elastic.shard import (
    ChunkLayout,
    ChunkPlacement,
    Piece,
    Plan,
    Range,
    ShardLost,
    chunk_size,
    make_chunk_layout,
    make_layout,
    node_of,
    place_replicas,
    plan_transfers,
)
from keepstep.elastic.shard.ring import PROBES, Ring, _member_points, dither
from keepstep.elastic.snapshot_shard import merge
from keepstep.errors import ConfigError

FAST = settings(max_examples=40, deadline=None)
# Realistic sizes: thousands of chunks. The same examples on every run: a random search
# found the uneven clusters of test_very_uneven_clusters_keep_the_bounds, and CI must say
# the same thing twice.
HEAVY = settings(max_examples=15, deadline=None, derandomize=True)


# Realistic: 10**7 elements or more, so each member's slice of a chunk is whole 128-element
# units (the ZeRO alignment) and every node owns hundreds of chunks.
realistic = st.lists(st.integers(1, 3 * 10**7), min_size=1, max_size=12).filter(
    lambda s: sum(s) >= 10**7
)


def owner_nodes(layout: ChunkLayout) -> list[str]:
    return [layout.ring.nodes[n] for n in layout.assignment.owners]


def next_nodes(layout: ChunkLayout) -> list[str | None]:
    return [layout.ring.nodes[n] if n >= 0 else None for n in layout.assignment.nexts]


def lost_copies(old: ChunkPlacement, node: str) -> int:
    """Elements of every copy (owned or kept) that lived on ``node``."""
    return sum(b - a for m, a, b, _ in old.holdings() if node_of(m) == node)


# --- tables -----------------------------------------------------------------------------


def test_the_hashing_and_the_assignment_are_pinned() -> None:
    # Every process must place every point alike, on every machine and Python: a change
    # to the hash, the probes or the assignment would reshuffle every job's state.
    points = [hex(p) for p in _member_points("n0/0")[:2]]
    assert points == ["0x76de47010136c8c2", "0xca309258f3414064"] and dither("n0") == 41875
    assert len(PROBES) == 8 and all(step % 2 for step, _ in PROBES)
    layout = make_chunk_layout(10**6, grid(3, 2), align=16)
    assert (layout.chunk, layout.chunks) == (672, 1489)
    assert "".join(node[1] for node in owner_nodes(layout)[:24]) == "221010122001210020222210"


def test_chunk_size_rounds_to_whole_slices() -> None:
    # 64 members on 8 nodes of 8: about 4,096 chunks (512 per node), 8 units apiece at
    # least, and a multiple of 8 units so each member's slice is whole units.
    assert chunk_size(10**9, grid(8, 8), 128) == 1912 * 128
    assert 1912 % 8 == 0 and -(-(10**9) // (1912 * 128)) <= 4096
    # Mixed 2- and 3-member nodes: a multiple of 6 units.
    assert chunk_size(10**8, [*grid(2, 2), *grid(5, 3)[6:]], 1) % 6 == 0
    # Tiny states: one node-sized chunk at least.
    assert chunk_size(10, grid(2, 4), 1) == 4


def test_cut_rotates_the_leftover_unit() -> None:
    layout = make_chunk_layout(30, ["a/0", "a/1", "a/2"], chunk=10)  # one node, 3 chunks
    assert layout.chunks == 3
    assert [layout.cut(c, 0) for c in range(3)] == [
        [0, 4, 7, 10],  # 10 = 3 + 3 + 3 + 1: the unit over goes to member c mod 3
        [10, 13, 17, 20],
        [20, 23, 26, 30],
    ]
    assert layout.shard_sizes() == [10, 10, 10]
    assert layout.ranges("a/1") == (Range(4, 7), Range(13, 17), Range(23, 26))
    assert layout.owner_of(16) == "a/1" and layout.owner_of(29) == "a/2"


def test_pieces_map_ranges_onto_the_tensors() -> None:
    layout = make_chunk_layout([4, 0, 6], ["a/0"], chunk=5)
    assert layout.ranges("a/0") == (Range(0, 10),)  # one member: its chunks merge
    assert layout.pieces("a/0") == [Piece(0, 0, 4), Piece(2, 0, 6)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk": 0}, r"chunk=0 must be an int >= 1"),
        ({"chunk": 10, "align": 4}, r"chunk=10 must be a multiple of align=4"),
        ({"slack": 1.5}, r"slack=1.5 must be a number in \[0, 1\]"),
        ({"align": 0}, r"align=0 must be an int >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_chunk_layout(100, grid(2, 1), **kwargs)  # type: ignore[arg-type]


def test_lookups_name_strangers_and_bad_elements() -> None:
    layout = make_chunk_layout(100, grid(2, 2))
    with pytest.raises(ConfigError, match=r"cannot remove \['x/0'\]: \['x/0'\] are not members"):
        layout.without(["x/0"])
    with pytest.raises(ConfigError, match="no member would stay"):
        layout.without(grid(2, 2))
    with pytest.raises(ConfigError, match="member='n9/0' is not in this layout"):
        layout.ranges("n9/0")
    with pytest.raises(ConfigError, match=r"element=100 is outside \[0, 100\)"):
        layout.owner_of(100)
    with pytest.raises(ConfigError, match=r"members \[3\] must be str"):
        make_chunk_layout(100, [3])  # type: ignore[list-item]


def test_a_chunks_ranking_keeps_its_order_as_members_come_and_go() -> None:
    # The property every other one rests on: a node's place among the others in a
    # chunk's ranking depends on nothing but the two nodes.
    big = Ring(grid(12, 2))
    small = Ring(grid(12, 2)[6:18])
    everyone = bytearray(b"\x01") * len(big.members)
    some = bytearray(b"\x01") * len(small.members)
    for c in range(50):
        full = [big.nodes[n] for n, _ in big.ranking(c, everyone)]
        part = [small.nodes[n] for n, _ in small.ranking(c, some)]
        assert [n for n in full if n in part] == part


def test_node_loss_table() -> None:
    members = grid(4, 2)
    old = place_replicas(make_chunk_layout(10**6, members, align=16))
    survivors = [m for m in members if node_of(m) != "n2"]
    new = place_replicas(old.layout.relayout(survivors))
    plan = plan_transfers(old, new, survivors)
    plan.verify()
    assert plan.lost_elements == old.lost(survivors) > 0
    # Every chunk n2 owned now belongs to the node that kept its replica.
    was = old.layout.ring.nodes
    for c in old.layout.chunks_of(old.layout.ring.node_id["n2"]):
        assert new.layout.owner_node(c) == old.copies[0][c]
        assert was[new.layout.owner_node(c)] != "n2"
    assert plan.elements(owners=True) == 0
    assert plan.elements() == lost_copies(old, "n2")  # exactly the copies n2 held


def test_a_drained_node_sends_the_replicas_it_kept() -> None:
    members = grid(4, 2)
    old = place_replicas(make_chunk_layout(10**6, members, align=16))
    leaving = ["n1/0", "n1/1"]
    new = place_replicas(old.layout.without(leaving))
    plan = plan_transfers(old, new, members)  # the drained node is still live
    plan.verify()
    assert plan.lost_elements == 0 and plan.elements(owners=True) == 0
    sent = plan.sent()
    assert all(sent[m] > 0 for m in leaving) and not any(d in leaving for d in plan.dst)
    assert plan.elements() == lost_copies(old, "n1")


def test_no_change_moves_nothing_and_kinds_do_not_mix() -> None:
    old = place_replicas(make_chunk_layout(10**5, grid(3, 2)))
    assert len(plan_transfers(old, old, grid(3, 2))) == 0
    assert (
        len(plan_transfers(old, place_replicas(old.layout.relayout(grid(3, 2))), grid(3, 2))) == 0
    )
    contiguous = place_replicas(make_layout(10**5, grid(3, 2)))
    with pytest.raises(ConfigError, match="cannot plan from a ChunkPlacement to a Placement"):
        plan_transfers(old, contiguous, grid(3, 2))  # type: ignore[call-overload]
    other = place_replicas(make_chunk_layout(10**5, grid(3, 2), chunk=7))
    with pytest.raises(ConfigError, match=r"into chunks of .* the same way"):
        plan_transfers(old, other, grid(3, 2))
    with pytest.raises(ConfigError, match=r"live=\['x/0'\] are not members"):
        plan_transfers(old, old, [*grid(3, 2), "x/0"])


def test_double_fault_raises_shard_lost() -> None:
    members = grid(3, 1)
    old = place_replicas(make_chunk_layout(3000, members))
    with pytest.raises(ShardLost, match="resume from the newest durable checkpoint") as caught:
        plan_transfers(old, place_replicas(old.layout.relayout(["n0/0"]), 0), ["n0/0"])
    lost = sum(r.size for r in caught.value.ranges)
    # Exactly the chunks whose owner and replica were both on n1 or n2.
    lay = old.layout
    gone = {lay.ring.node_id["n1"], lay.ring.node_id["n2"]}
    both = [c for c in range(lay.chunks) if set(old.holders(c)) <= gone]
    assert lost == sum(lay.chunk_range(c).size for c in both) > 0


def test_two_replicas_survive_two_lost_nodes() -> None:
    small = make_chunk_layout(1000, grid(2, 3))
    with pytest.raises(ConfigError, match=r"replicas=2 needs members on at least 3 nodes"):
        place_replicas(small, 2)
    assert place_replicas(small, 0).copies == ()
    members = grid(5, 2)
    old = place_replicas(make_chunk_layout(10**5, members), 2)
    for c in range(old.layout.chunks):
        assert len({old.layout.ring.nodes[n] for n in old.holders(c)}) == 3
    survivors = [m for m in members if node_of(m) in ("n0", "n1", "n2")]
    plan = plan_transfers(old, place_replicas(old.layout.relayout(survivors), 2), survivors)
    plan.verify()


# --- properties -------------------------------------------------------------------------


@FAST
@given(clusters(), st.lists(st.integers(0, 5000), min_size=1, max_size=12), st.data())
def test_every_element_has_one_owner(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    align = data.draw(st.sampled_from([1, 4, 128]), label="align")
    layout = make_chunk_layout(sizes, members, align=align)
    total = sum(sizes)
    owned = sorted(r for m in members for r in layout.ranges(m))
    assert all(a.stop <= b.start for a, b in itertools.pairwise(owned))
    assert sum(r.size for r in owned) == total == sum(layout.shard_sizes())
    rnd = random.Random(total)
    for element in (rnd.randrange(total) for _ in range(20 if total else 0)):
        who = layout.owner_of(element)
        assert any(a <= element < b for a, b in layout.ranges(who))
    for m in members:
        pieces = layout.pieces(m)
        assert sum(p.stop - p.start for p in pieces) == sum(r.size for r in layout.ranges(m))
        assert all(0 <= p.start < p.stop <= sizes[p.tensor] for p in pieces)


@HEAVY
@given(clusters(), realistic)
def test_balance_within_ten_percent(members: list[str], sizes: list[int]) -> None:
    layout = make_chunk_layout(sizes, members, align=128)
    mean = sum(sizes) / len(members)
    assert max(layout.shard_sizes()) <= 1.1 * mean
    # The replicas each member keeps too (ZeRO-1 steps them): within 10% of the mean,
    # unless one node owns more than the others' caps can keep (then some spill).
    if not layout.assignment.spilled and len(layout.node_members) > 1:
        kept = place_replicas(layout).load()
        assert max(kept.values()) <= 1.1 * mean


@FAST
@given(clusters(min_nodes=2), st.lists(st.integers(0, 10**6), min_size=1, max_size=12))
def test_replicas_are_a_stable_assignment_under_the_caps(
    members: list[str], sizes: list[int]
) -> None:
    # Each replica is on a node other than its owner's, no node keeps more replicas than
    # its cap (spills aside), a replica spills only when every other node is full of
    # nearer ones, and no chunk would rather be at a node that has room or keeps a
    # farther replica.
    layout = make_chunk_layout(sizes, members, chunk=max(1, sum(sizes) // 500))
    a = layout.assignment
    nodes = range(len(a.groups))
    kept = Counter(a.nexts[c] for c in range(layout.chunks) if c not in a.spilled)
    assert all(kept[n] == a.rloads[n] <= a.caps[n] for n in nodes)
    farthest = {
        n: max((a.rdists[c] for c in a.by_next.get(n, ()) if c not in a.spilled), default=-1)
        for n in nodes
    }
    for c in range(layout.chunks):
        owner, holder = a.owners[c], a.nexts[c]
        assert holder != owner and holder >= 0
        assert c in a.by_next[holder]
        for n, dist in a.ring.ranking(c, a.present, a.live):
            if n == holder and c not in a.spilled:
                break  # every node it prefers turned it away, and would again
            if n != owner:
                assert kept[n] >= a.caps[n] and farthest[n] < dist, (c, n)


def test_replicas_spill_only_where_the_caps_cannot_hold_them() -> None:
    # Two nodes: every chunk's replica must be on the other one. n0 owns more chunks than
    # n1's cap, so some of n0's replicas spill onto n1 above its cap; none of n1's do.
    layout = make_chunk_layout(10**5, ["n0/0", "n0/1", "n0/2", "n1/0"], chunk=50)
    a = layout.assignment
    n0, n1 = (layout.ring.node_id[n] for n in ("n0", "n1"))
    assert a.loads[n0] > a.caps[n1] and a.rloads[n1] == a.caps[n1]
    assert len(a.spilled) == a.loads[n0] - a.caps[n1]
    assert all(a.owners[c] == n0 and a.nexts[c] == n1 for c in a.spilled)
    assert all(a.nexts[c] == n0 for c in a.by_node[n1])
    # A third node of three members has room for them: nothing spills.
    grown = make_chunk_layout(10**5, [*layout.members, "n2/0", "n2/1", "n2/2"], chunk=50)
    assert not grown.assignment.spilled


@FAST
@given(clusters(), st.lists(st.integers(0, 10**6), min_size=1, max_size=12), st.data())
def test_determinism_whatever_the_member_order(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    chunk = max(1, sum(sizes) // 1000)  # about 1,000 chunks: the order is what is tested
    layout = make_chunk_layout(sizes, members, chunk=chunk)
    shuffled = data.draw(st.permutations(members), label="order")
    again = make_chunk_layout(sizes, shuffled, chunk=chunk)
    assert owner_nodes(again) == owner_nodes(layout)
    assert all(again.ranges(m) == layout.ranges(m) for m in members)


@HEAVY
@given(clusters(), realistic, st.booleans())
def test_a_join_takes_about_its_share(members: list[str], sizes: list[int], fresh: bool) -> None:
    old = place_replicas(make_chunk_layout(sizes, members, align=128), 0)
    joiner = "new/0" if fresh else f"{node_of(members[0])}/99"  # a node, or a worker
    layout = old.layout.relayout([*members, joiner])
    plan = plan_transfers(old, place_replicas(layout, 0), members)
    plan.verify()
    share = sum(sizes) / (len(members) + 1)
    got = plan.received()[joiner]
    # Its node's chunks are drawn by rank, so the joiner's share varies by the sampling
    # noise of its node's chunk count (the bound caps it only from above).
    mine = layout.node_members[layout.ring.node_id[node_of(joiner)]]
    chunks = layout.chunks * len(mine) / len(layout)
    assert share * (1 - 3 / chunks**0.5) <= got <= 1.1 * share + layout.chunk
    # A new node: little besides its share moves. A worker joining a node that stays:
    # that node's chunks are cut anew among its members.
    recut = 0 if fresh else sum(layout.shard_sizes()[layout.index(m)] for m in mine)
    assert plan.elements() <= 1.25 * got + recut


@FAST
@given(clusters(min_nodes=2), st.lists(st.integers(0, 10**6), min_size=1, max_size=12), st.data())
def test_derived_layouts_equal_fresh_ones(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    # Any members may leave (whole nodes or single workers, several at once), twice. Few
    # chunks make the caps tight, so that replicas spill and come back.
    chunk = max(1, sum(sizes) // data.draw(st.sampled_from([50, 300, 2000]), label="chunks"))
    layout = first = make_chunk_layout(sizes, members, chunk=chunk)
    before = owner_nodes(first), next_nodes(first), set(first.assignment.spilled)
    for _ in range(2):
        gone = data.draw(st.sets(st.sampled_from(layout.members), max_size=len(layout) - 1))
        layout = layout.without(gone)
        fresh = make_chunk_layout(sizes, layout.members, chunk=chunk)
        assert owner_nodes(layout) == owner_nodes(fresh)
        assert next_nodes(layout) == next_nodes(fresh)  # where the replicas go
        assert layout.assignment.spilled == fresh.assignment.spilled
    assert (owner_nodes(first), next_nodes(first), first.assignment.spilled) == before


def unrecoverable(old: ChunkPlacement, dead: set[str]) -> int:
    """Elements whose every holder (owner's slice, replicas' slices) is dead."""
    lay = old.layout
    out = 0
    for c in range(lay.chunks):
        cuts = [(lay.node_members[n], lay.cut(c, n)) for n in old.holders(c)]
        points = sorted({p for _, cut in cuts for p in cut})
        for a, b in itertools.pairwise(points):
            holders = [m for ms, cut in cuts for i, m in enumerate(ms) if cut[i] <= a < cut[i + 1]]
            if b > a and all(m in dead for m in holders):
                out += b - a
    return out


@settings(max_examples=25, deadline=None)
@given(clusters(min_nodes=2), st.lists(st.integers(0, 4000), min_size=1, max_size=6), st.data())
def test_any_change_is_planned_or_reported_lost(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    # Losses anywhere (several nodes, single workers), joiners: a plan exists exactly when
    # every element keeps a live holder, and then it is complete.
    old = place_replicas(make_chunk_layout(sizes, members))
    dead = data.draw(st.sets(st.sampled_from(members), max_size=len(members) - 1), label="dead")
    live = [m for m in members if m not in dead]
    new_members = live + [f"j{i}/0" for i in range(data.draw(st.integers(0, 2), label="join"))]
    replicas = min(1, len({node_of(m) for m in new_members}) - 1)
    new = place_replicas(old.layout.relayout(new_members), replicas)
    doomed = unrecoverable(old, dead)
    if doomed:
        with pytest.raises(ShardLost) as caught:
            plan_transfers(old, new, live)
        assert sum(r.size for r in caught.value.ranges) == doomed
        return
    plan: Plan[ChunkPlacement] = plan_transfers(old, new, live)
    plan.verify()
    assert all(s in live for s in plan.src)
    assert Counter(plan.copy).keys() <= {0, 1}


@FAST
@given(clusters(), st.lists(st.integers(0, 5000), min_size=1, max_size=12), st.data())
def test_member_ranges_are_the_ranges_and_holdings_of_every_member(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    chunk = data.draw(st.integers(1, 64), label="chunk")
    layout = make_chunk_layout(sizes, members, chunk=chunk)
    nodes = len({node_of(m) for m in members})
    placement = place_replicas(layout, replicas=data.draw(st.integers(0, min(2, nodes - 1))))
    owned, kept = placement.member_ranges()
    held: dict[str, list[Range]] = {}
    for m, a, b, _copy in placement.holdings():
        held.setdefault(m, []).append(Range(a, b))
    for m in members:
        assert owned.get(m, ()) == layout.ranges(m)
        assert kept.get(m, ()) == merge(held.get(m, ()))
