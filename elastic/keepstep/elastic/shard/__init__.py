"""keepstep.elastic.shard: sharded optimizer state with interleaved replicas.

Where it sits: the pure part of ZeRO-style sharding, beside the micro-batch plan
(``keepstep.elastic.plan``): given the agreed membership, every member computes the same
layout, replica placement and transfer plan without talking to the others. The data
plane (stepping a shard, all-gathering parameters, running the moves over the epoch's
communicator) builds on it. Torch-free: tools and the agent may import it too.

    layout.py    who owns which contiguous slice of the flattened state (balanced)
    replicas.py  who keeps copies of each shard, on other nodes; ``ShardLost``
    plan.py      the moves from an old (layout, copies, survivors) to a new one

    layout = make_layout(sizes, members)
    copies = place_replicas(layout, replicas=1)
    ...                                   # a node is lost; the agents agree on survivors
    plan = plan_transfers(copies, place_replicas(make_layout(sizes, survivors)), survivors)
"""

from keepstep.elastic.shard.layout import (
    Layout,
    Piece,
    Range,
    make_layout,
    node_of,
    owner_changes,
)
from keepstep.elastic.shard.plan import Move, Plan, plan_transfers
from keepstep.elastic.shard.replicas import (
    Placement,
    PlacementRule,
    ShardLost,
    place_replicas,
    recovery_senders,
)

__all__ = [
    "Layout",
    "Move",
    "Piece",
    "Placement",
    "PlacementRule",
    "Plan",
    "Range",
    "ShardLost",
    "make_layout",
    "node_of",
    "owner_changes",
    "place_replicas",
    "plan_transfers",
    "recovery_senders",
]
