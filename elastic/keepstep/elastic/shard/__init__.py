"""keepstep.elastic.shard: sharded optimizer state with interleaved replicas.

Where it sits: the pure part of ZeRO-style sharding, beside the micro-batch plan
(``keepstep.elastic.plan``): given the agreed membership, every member computes the same
layout, replica placement and transfer plan without talking to the others. The data
plane (stepping a shard, all-gathering parameters, running the moves over the epoch's
communicator) builds on it. Torch-free: tools and the agent may import it too.

    layout.py    who owns which contiguous slice of the flattened state (balanced)
    replicas.py  who keeps copies of each shard, on other nodes
    plan.py      the moves from an old (layout, copies, survivors) to a new one
    moves.py     what a plan is (``Move``, ``Plan``) and what it cannot save (``ShardLost``)

    The chunked layout (a second mode: a loss moves close to the lost bytes, not ~W/4):
    chunks.py    fixed chunks owned by nodes under a load bound, sliced among members
    ring.py      how a chunk ranks the nodes (points on a circle, probed)
    assign.py    the bounded stable assignment, built or derived after a loss
    replica_assign.py  the same for each chunk's replica, over the other nodes
    accept.py    one side of deferred acceptance, as both passes above run it
    blocks.py    per-chunk columns that derived layouts share until they differ
    copies.py    replicas on the assigned and next nodes; the chunked transfer plan
    fetch.py     entering an epoch: who sends which held elements to whom (disjoint)

    layout = make_layout(sizes, members)
    copies = place_replicas(layout, replicas=1)
    ...                                   # a node is lost; the agents agree on survivors
    plan = plan_transfers(copies, place_replicas(make_layout(sizes, survivors)), survivors)

    layout = make_chunk_layout(sizes, members, align=128)   # the chunked mode: the same
    copies = place_replicas(layout)                         # calls, and relayout keeps
    plan = plan_transfers(copies, place_replicas(layout.relayout(survivors)), survivors)
"""

from keepstep.elastic.shard.chunks import ChunkLayout, chunk_size, make_chunk_layout
from keepstep.elastic.shard.copies import ChunkPlacement
from keepstep.elastic.shard.layout import (
    Layout,
    Piece,
    Range,
    make_layout,
    node_of,
    owner_changes,
)
from keepstep.elastic.shard.moves import Move, Plan, ShardLost
from keepstep.elastic.shard.plan import plan_transfers
from keepstep.elastic.shard.replicas import (
    Placement,
    PlacementRule,
    place_replicas,
    recovery_senders,
)

__all__ = [
    "ChunkLayout",
    "ChunkPlacement",
    "Layout",
    "Move",
    "Piece",
    "Placement",
    "PlacementRule",
    "Plan",
    "Range",
    "ShardLost",
    "chunk_size",
    "make_chunk_layout",
    "make_layout",
    "node_of",
    "owner_changes",
    "place_replicas",
    "plan_transfers",
    "recovery_senders",
]
