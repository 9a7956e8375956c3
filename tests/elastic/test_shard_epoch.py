"""epoch_shards: the chunked layout's ranges and holdings, mapped from the padded
flattening (every parameter on an ALIGN boundary) back to the real offsets."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.shard import Range, make_chunk_layout, place_replicas
from keepstep.elastic.shard_epoch import JOB_CHUNKS, epoch_shards
from keepstep.elastic.snapshot_shard import merge
from keepstep.elastic.zero import ALIGN


def _elements(ranges: Iterable[Range]) -> set[int]:
    return {e for r in ranges for e in range(r.start, r.stop)}


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 700), min_size=1, max_size=8),
    st.integers(1, 5),
    st.integers(1, 3),
)
def test_owned_and_held_are_the_layouts_elements_without_the_padding(
    sizes: list[int], nodes: int, per_node: int
) -> None:
    members = [f"n{n}/{i}" for n in range(nodes) for i in range(per_node)]
    shards = epoch_shards(sizes, members)
    padded_sizes = [-(-n // ALIGN) * ALIGN for n in sizes]
    padded, real = [0, *accumulate(padded_sizes)], [0, *accumulate(sizes)]
    chunk = ALIGN * max(1, -(-padded[-1] // ALIGN // JOB_CHUNKS))
    layout = make_chunk_layout(padded_sizes, members, align=ALIGN, chunk=chunk)
    placement = place_replicas(layout, replicas=1 if nodes > 1 else 0)

    def unpadded(ranges: Iterable[Range]) -> set[int]:
        out = set()
        for e in _elements(ranges):
            t = bisect_right(padded, e) - 1  # the parameter whose padded span holds e
            if e - padded[t] < sizes[t]:
                out.add(real[t] + e - padded[t])
        return out

    held: dict[str, list[Range]] = {}
    for m, a, b, _copy in placement.holdings():
        held.setdefault(m, []).append(Range(a, b))
    for m in members:
        assert _elements(shards.owned[m]) == unpadded(layout.ranges(m))
        assert _elements(shards.held[m]) == unpadded(held.get(m, ()))
        assert shards.owned[m] == merge(shards.owned[m])  # sorted, touching ones joined
        assert shards.held[m] == merge(shards.held[m])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    st.integers(2, 6),
    st.integers(1, 3),
    st.data(),
)
def test_an_epoch_derived_from_the_last_has_the_shards_of_a_fresh_one(
    sizes: list[int], nodes: int, per_node: int, data: st.DataObject
) -> None:
    members = [f"n{n}/{i}" for n in range(nodes) for i in range(per_node)]
    shards = epoch_shards(sizes, members)
    for _ in range(2):  # members leave twice (a loss, a drain), then one joins
        gone = data.draw(st.sets(st.sampled_from(members), max_size=len(members) - 1))
        members = [m for m in members if m not in gone]
        shards = epoch_shards(sizes, members, shards)
        assert shards == epoch_shards(sizes, members)
    members = sorted({*members, "n9/0"})
    assert epoch_shards(sizes, members, shards) == epoch_shards(sizes, members)
