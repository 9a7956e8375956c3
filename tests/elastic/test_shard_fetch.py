"""The disjoint fetch plan (keepstep.elastic.shard.fetch): tables and properties.

Every needed element that a member lacks comes from exactly one live holder, no element
travels twice, nobody is sent what it holds, the sends are balanced over the holders,
and what no member holds is reported as lost. The chunked layout's own case, one node
lost with one replica, moves no more than the lost elements.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.shard import make_chunk_layout, place_replicas
from keepstep.elastic.shard.fetch import (
    Announcement,
    BadAnnouncement,
    decode,
    encode,
    limit,
    plan_fetches,
)
from keepstep.elastic.shard.layout import Range
from keepstep.elastic.snapshot_shard import snapshot_ranges

R = Range


def _covered(ranges: list[Range]) -> set[int]:
    return {x for r in ranges for x in range(r.start, r.stop)}


def test_a_table_of_holders() -> None:
    # Rank 0 lost its state (a joiner); rank 1 and 2 hold [0, 60) between them, both [20, 40).
    announced = [
        Announcement(held=(), need=(R(0, 30),)),
        Announcement(held=(R(0, 40),), need=(R(30, 45),)),
        Announcement(held=(R(20, 60),), need=(R(45, 60),)),
    ]
    plan = plan_fetches(announced)
    assert plan.lost == ()
    # [0, 20) only rank 1 holds; [20, 30) goes to rank 2, which has sent less so far.
    assert plan.sends[1][0] == (R(0, 20),)
    assert plan.sends[2][0] == (R(20, 30),)
    # Rank 1 holds [30, 40) of its need already and fetches [40, 45) from rank 2.
    assert plan.sends[2][1] == (R(40, 45),)
    assert plan.sends[0] == ((), (), ())
    assert plan.sends[1][2] == () and plan.sends[2][2] == ()  # nothing to itself
    assert (plan.sent(1), plan.sent(2), plan.received(0), plan.received(1)) == (20, 15, 30, 5)


def test_what_no_member_holds_is_lost_and_nothing_is_made_up() -> None:
    announced = [
        Announcement(held=(R(0, 10),), need=(R(0, 10), R(90, 100))),
        Announcement(held=(R(40, 50),), need=(R(5, 45),)),
    ]
    plan = plan_fetches(announced)
    assert plan.lost == (R(10, 40), R(90, 100))
    assert plan.sends[0][1] == (R(5, 10),)
    assert plan.sends[1][0] == ()
    nothing = plan_fetches([Announcement((), (R(0, 5),)), Announcement((), ())])
    assert nothing.lost == (R(0, 5),) and nothing.sent(0) == nothing.sent(1) == 0


@st.composite
def _announcements(draw: st.DrawFn) -> tuple[int, list[Announcement]]:
    total = draw(st.integers(1, 400))
    world = draw(st.integers(1, 9))

    def ranges() -> tuple[Range, ...]:
        cuts = sorted(set(draw(st.lists(st.integers(0, total), max_size=8))))
        pairs = list(zip(cuts[::2], cuts[1::2], strict=False))
        return tuple(R(a, b) for a, b in pairs if b > a)

    return total, [Announcement(ranges(), ranges()) for _ in range(world)]


@settings(max_examples=300, deadline=None)
@given(_announcements())
def test_every_needed_element_comes_once_from_a_holder(
    case: tuple[int, list[Announcement]],
) -> None:
    total, announced = case
    plan = plan_fetches(announced)
    held = [_covered(list(a.held)) for a in announced]
    anywhere = set().union(*held)
    lost = _covered(list(plan.lost))
    for dst, a in enumerate(announced):
        missing = _covered(list(a.need)) - held[dst]
        got: list[int] = []
        for src in range(len(announced)):
            ranges = plan.sends[src][dst]
            assert list(ranges) == sorted(ranges)
            assert all(r.stop > r.start for r in ranges)
            if src == dst:
                assert ranges == ()
            for r in ranges:
                assert set(range(r.start, r.stop)) <= held[src]  # only what src holds
                got += range(r.start, r.stop)
        assert len(got) == len(set(got))  # no element twice
        assert set(got) == missing - lost  # all that is missing and held somewhere
        assert (missing - anywhere) <= lost
    assert lost <= set(range(total)) - anywhere


def test_one_node_lost_moves_the_lost_elements_to_their_replicas_holders_only() -> None:
    rng = random.Random(7)
    for nodes, per_node in [(2, 1), (4, 1), (4, 2), (8, 1), (16, 2)]:
        sizes = [rng.randrange(1, 40_000) for _ in range(rng.randrange(1, 12))]
        members = [f"n{n}/{i}" for n in range(nodes) for i in range(per_node)]
        chunk = 128 * max(1, -(-sum(sizes) // 128 // 4096))
        before = make_chunk_layout(sizes, members, align=128, chunk=chunk)
        holds = snapshot_ranges(place_replicas(before, replicas=1))
        gone = {m for m in members if m.startswith(f"n{rng.randrange(nodes)}/")}
        survivors = [m for m in members if m not in gone]
        after = make_chunk_layout(sizes, survivors, align=128, chunk=chunk)
        announced = [
            Announcement(tuple(holds.get(m, ())), tuple(after.ranges(m))) for m in survivors
        ]
        plan = plan_fetches(announced)
        assert plan.lost == ()
        lost_elements = sum(r.size for m in gone for r in before.ranges(m))
        moved = sum(plan.sent(s) for s in range(len(survivors)))
        # Owners of the lost chunks mostly hold their replicas: well under the lost share.
        assert moved <= 1.1 * lost_elements, (nodes, per_node, moved, lost_elements)


def test_announcements_round_trip_and_bad_ones_are_refused() -> None:
    a = Announcement(held=(R(0, 5), R(7, 9)), need=(R(1, 2),))
    raw = encode(a)
    assert decode(raw, 9) == a
    assert len(raw) <= limit(9)
    assert decode(encode(Announcement((), ())), 0) == Announcement((), ())
    cases = [
        (raw[:-3], "not a whole number"),
        (raw, "outside the state's 8 elements"),  # total 8 < 9
        (encode(Announcement((R(5, 7), R(0, 2)), ())), "unsorted"),
        (encode(Announcement((R(3, 3),), ())), "empty"),
        (encode(Announcement((R(0, 2),), ())) + raw[:8], "left over"),
        (b"\x05" + b"\0" * 7, "held count 5 does not fit"),
        (b"", "held count is missing"),
    ]
    for bad, message in cases:
        with pytest.raises(BadAnnouncement, match=re.escape(message)):
            decode(bad, 8)
