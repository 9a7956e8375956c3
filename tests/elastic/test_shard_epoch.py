"""epoch_shards: the chunked layout's ranges and holdings, mapped from the padded
flattening (every parameter on an ALIGN boundary) back to the real offsets."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic.shard import Range, make_chunk_layout, place_replicas
from keepstep.elastic.shard.chunks import MAX_CHUNKS
from keepstep.elastic.shard_epoch import (
    JOB_CHUNKS,
    MIN_CHUNK,
    agreed_chunks,
    epoch_shards,
    job_chunks,
)
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


@pytest.mark.parametrize(
    ("nodes", "chunks"),
    [
        (1, 1024),
        (8, 1024),
        (16, 1024),
        (17, 2048),
        (32, 2048),
        (33, 4096),
        (64, 4096),
        (65, 8192),
        (1000, 65536),
        (10**6, MAX_CHUNKS),
    ],
)
def test_a_job_cuts_more_chunks_as_its_nodes_outgrow_them(nodes: int, chunks: int) -> None:
    assert job_chunks(nodes) == chunks
    if JOB_CHUNKS < chunks < MAX_CHUNKS:  # past 16 nodes: 64 to 127 chunks a node
        assert 64 * nodes <= chunks < 128 * nodes


@pytest.mark.parametrize(
    ("nodes", "elements", "chunks"),
    [
        (8, 116_480, 256),  # the benchmark transformer: 32 chunks a member, not 1,024
        (4, 116_480, 128),
        (1, 10, 32),
        (8, 20 * MIN_CHUNK, 256),  # 256 chunks of under MIN_CHUNK: as few as 8 allow
        (8, 600 * MIN_CHUNK, 512),  # halved while a chunk holds under MIN_CHUNK
        (8, 1024 * MIN_CHUNK, 1024),  # large enough: as many as without the size
        (16, 10, 512),
        (17, 10, 2048),  # past 16, 64 each whatever the model
        (40, 10, 4096),
        (64, 184 * 10**6, 4096),  # not the 2,048 that MIN_CHUNK alone would give
        (40, 10**12, 4096),
    ],
)
def test_a_small_model_is_cut_into_fewer_chunks_but_32_a_member(
    nodes: int, elements: int, chunks: int
) -> None:
    got = job_chunks(nodes, elements)
    assert got == chunks
    assert got >= 32 * nodes and got <= job_chunks(nodes)
    if nodes <= 16:
        assert elements >= MIN_CHUNK * got or got // 2 < 32 * nodes  # halved no further
    else:
        assert got == job_chunks(nodes)


def test_the_agreed_count_is_the_largest_any_member_cut_unless_the_epoch_outgrew_it() -> None:
    big = 10**12  # elements: a model whose chunks are all large
    eight = [f"n{n}/{i}" for n in range(8) for i in range(2)]  # 8 nodes, 16 members
    assert agreed_chunks(eight, (), big) == 1024  # a first epoch: its nodes' count
    assert agreed_chunks(eight, [None] * 16, big) == 1024
    # After a loss (40 nodes -> 8) the survivors keep what they cut; a restarted worker
    # (None: it entered no epoch yet) takes the others' count.
    assert agreed_chunks(eight, [4096, None, *[4096] * 14], big) == 4096
    forty = [f"n{n}/0" for n in range(40)]
    assert agreed_chunks(forty, [1024] * 39 + [None], big) == 4096  # outgrown at a join
    assert agreed_chunks(["m0", "m1"], [None, 2048], big) == 2048  # local names: a node each
    # A small model: 32 chunks a member of its first epoch, kept after a loss (16
    # members -> 4 keep 512; 4 alone would cut 128) ...
    small = 116_480
    assert agreed_chunks(eight, (), small) == 512
    four = [f"n{n}/0" for n in range(4)]
    assert agreed_chunks(four, (), small) == 128
    assert agreed_chunks(four, [512, 512, None, 512], small) == 512
    # ... and cut anew only when a join outgrows it: past 16 members, 64 a member
    # whatever the model.
    assert agreed_chunks([*eight, "n8/0"], [512] * 16 + [None], small) == 2048


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    st.integers(2, 5),
    st.sampled_from([1, 3, 8, 1024, 4096]),
)
def test_shards_are_cut_into_the_chunks_given_and_derive_only_from_the_same(
    sizes: list[int], nodes: int, chunks: int
) -> None:
    members = [f"n{n}/0" for n in range(nodes)]
    shards = epoch_shards(sizes, members, chunks=chunks)
    units = sum(-(-n // ALIGN) for n in sizes)
    assert shards.chunks == chunks
    assert shards.layout is not None and shards.layout.chunk == ALIGN * max(1, -(-units // chunks))
    survivors = members[1:]
    for other in (chunks, 2 * chunks):  # derived from the last epoch, or cut afresh
        after = epoch_shards(sizes, survivors, shards, other)
        assert after == epoch_shards(sizes, survivors, chunks=other) and after.chunks == other
