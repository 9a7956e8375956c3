"""A single-node loss of the chunked layout (keepstep.elastic.shard), for 2..64 members on
2..16 nodes and random tensor sizes: the lost chunks' new owners already hold them (unless
the load bound sent one on); owners fetch at most 10% of the lost elements; replicas move
little beyond the copies the lost node held (within 10% of the lost elements with even
nodes, more where node sizes are uneven); the plan is complete and the re-replication is
spread over the survivors.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_shard_chunks import HEAVY, lost_copies, realistic
from test_shard_layout import clusters

from keepstep.elastic.shard import (
    ChunkLayout,
    chunk_size,
    make_chunk_layout,
    node_of,
    place_replicas,
    plan_transfers,
)


@pytest.mark.timeout(300)  # thousands of chunks per example: slow on a loaded machine
@HEAVY
@given(clusters(min_nodes=2), realistic, st.data())
def test_single_node_loss(members: list[str], sizes: list[int], data: st.DataObject) -> None:
    node = data.draw(st.sampled_from(sorted({node_of(m) for m in members})), label="lost")
    check_single_node_loss(members, sizes, node)


@st.composite
def even_clusters(draw: st.DrawFn) -> list[str]:
    """2..16 nodes of the same member count, one of them sometimes a member short (a
    worker lost): how clusters of GPU machines look."""
    n_nodes = draw(st.integers(2, 16))
    per_node = draw(st.integers(1, 64 // n_nodes))
    short = draw(st.integers(-1, n_nodes - 1)) if per_node > 1 else -1
    return [f"n{n}/{w}" for n in range(n_nodes) for w in range(per_node - (n == short))]


@pytest.mark.timeout(300)  # thousands of chunks per example: slow on a loaded machine
@HEAVY
@given(even_clusters(), realistic, st.data())
def test_single_node_loss_of_even_nodes(
    members: list[str], sizes: list[int], data: st.DataObject
) -> None:
    node = data.draw(st.sampled_from(sorted({node_of(m) for m in members})), label="lost")
    check_single_node_loss(members, sizes, node)  # replicas: within 10% of the lost


# Found by test_single_node_loss's random search: one node of 14 members, one of 4 or 6,
# most of one or two. Node sizes 14, 6 (or 4), 2 and 1 made chunk_size round each chunk up
# to 28 units, half the chunks aimed at; with ~120 chunks on a one-member node its load
# was noisy enough that losing one (n2) sent 13% of the lost elements to new owners, and
# one member sent 71,680 elements, over twice the survivors' mean plus a chunk. Now the
# chunk rounds to the nearest multiple (14 units), and both bounds hold for every node
# lost. The replicas move more here, within 20% of the lost elements beyond the copies:
# the big node cannot keep its own chunks' replicas, so the small nodes' replica caps
# bind, and each cap that grows as the world shrinks takes back replicas it turned away.
_BIG, _ONES = [f"n0/{i}" for i in range(14)], [f"n{i}/0" for i in range(8, 16)]
_PAIRS = ["n2/0", "n3/0", "n4/0", "n4/1", "n5/0", "n5/1", "n6/0", "n6/1", "n7/0"]


@pytest.mark.timeout(300)  # thousands of chunks per loss: slow on a loaded machine
@pytest.mark.parametrize(
    ("members", "sizes"),
    [
        ([*_BIG, *(f"n1/{i}" for i in range(6)), *_PAIRS, "n7/1", *_ONES], [15436286]),
        ([*_BIG, *(f"n1/{i}" for i in range(4)), *_PAIRS, *_ONES], [15721513]),
    ],
)
def test_very_uneven_clusters_keep_the_bounds(members: list[str], sizes: list[int]) -> None:
    assert chunk_size(sum(sizes), members, 128) == 14 * 128
    for node in ("n0", "n1", "n2", "n4", "n8", "n15"):
        check_single_node_loss(members, sizes, node, replica_extra=0.2)


def test_losing_the_node_of_most_members() -> None:
    """Found by the test above: three of four members lost, the layout made afresh."""
    check_single_node_loss(["n0/0", "n0/1", "n0/2", "n1/0"], [2240, 10093327], "n0")


# Replicas moved beyond the copies the lost node held, over the elements it owned, where
# node sizes differ by more than one member. The replica caps bind on most nodes then, and
# every cap that grows as the world shrinks takes back replicas it had turned away (see
# replica_assign.py): a random search of 2,800 single-node losses of such clusters (2-16
# nodes, 2-64 members) found at most 0.59, above 0.1 in one loss of seven. Found by
# test_single_node_loss, which asserted 0.1 for every cluster: nine nodes of 1-10 members
# lost their two-member node and moved 0.12.
UNEVEN_REPLICA_EXTRA = 0.75


def even_nodes(layout: ChunkLayout) -> bool:
    """Whether the node sizes differ by at most one member (equal nodes, one worker lost)."""
    counts = [len(ms) for ms in layout.node_members.values()]
    return max(counts) - min(counts) <= 1


@pytest.mark.parametrize("node", ["n0", "n5", "n8"])
def test_uneven_nodes_keep_the_looser_replica_bound(node: str) -> None:
    counts = {"n0": 2, "n1": 6, "n2": 3, "n3": 3, "n4": 6, "n5": 10, "n6": 4, "n7": 6, "n8": 1}
    members = [f"{n}/{i}" for n, k in counts.items() for i in range(k)]
    sizes = [74256, 74256, 998690, 998690, 16481693, 16777217]
    check_single_node_loss(members, sizes, node)


def check_single_node_loss(
    members: list[str], sizes: list[int], node: str, replica_extra: float | None = None
) -> None:
    old = place_replicas(make_chunk_layout(sizes, members, align=128))
    if replica_extra is None:
        replica_extra = 0.1 if even_nodes(old.layout) else UNEVEN_REPLICA_EXTRA
    lost_members = [m for m in members if node_of(m) == node]
    layout = old.layout.without(lost_members)
    replicas = min(1, len(layout.node_members) - 1)
    plan = plan_transfers(old, place_replicas(layout, replicas), layout.members)
    plan.verify()
    lost = plan.lost_elements
    lay = old.layout
    # Each chunk the lost node owned now belongs to the node that kept its replica, with
    # the data in place, unless the load bound sent it on (that node was full).
    fetched = {a // lay.chunk for a, k in zip(plan.start, plan.copy, strict=True) if k == 0}
    gone = lay.ring.node_id[node]
    # By name: a layout left with under half its members is made afresh and numbers its
    # nodes anew.
    old_name = {i: n for n, i in lay.ring.node_id.items()}
    new_name = {i: n for n, i in layout.ring.node_id.items()}
    for c in lay.chunks_of(gone):
        assert new_name[layout.owner_node(c)] == old_name[old.copies[0][c]] or c in fetched
    # In all, owners fetch what the bound moves: at most 10% of the lost bytes.
    assert plan.elements(owners=True) <= 0.1 * lost
    # Replicas: a new copy of every chunk the lost node owned, the copies it kept, and
    # what the bounds moved: at most 10% of the lost elements with even nodes.
    recreate = lost_copies(old, node) - lost + (lost if replicas else 0)
    assert plan.elements(owners=False) <= recreate + replica_extra * lost
    # Re-replication is spread: each chunk is sent by its one live holder, so a member
    # sends about its share of what the lost node held: at most one shard's worth when 4
    # or more equal nodes remain, and never far above the survivors' mean.
    sent = max(plan.sent().values(), default=0)
    assert sent <= 2 * plan.elements() / len(layout.members) + lay.chunk
    sizes_of_nodes = {len(ms) for ms in lay.node_members.values()}
    if len(sizes_of_nodes) == 1 and len(layout.node_members) >= 4:
        assert sent <= max(lay.shard_sizes())
