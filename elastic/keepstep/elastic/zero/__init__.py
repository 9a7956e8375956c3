"""keepstep.elastic.zero: ZeRO-1 in the exact mode, the data plane.

Where it sits: between the exact reduction (every member holds the same averaged gradient)
and the commit. The pure layout (``keepstep.elastic.shard``) says who owns which elements;
here a member steps its own elements only, keeps optimizer state for them only, and
all-gathers the parameters, with bits identical to the unsharded step at any world size.

    ownership.py   the layout in rank order, checked (one owner per element); windows
    optimizers.py  which optimizers are elementwise; rebuilding the script's over a shard
    muon.py        Muon: sharded momentum, its whole-matrix step, which rank steps which
    matrices.py    WholeMatrices: Muon's matrices gathered to and stepped on their rank
    clip.py        ZeRO-2's windows clipped with the whole gradient's norm, never gathered
    state.py       the shard's state: cut from the full state, joined, gathered
    gather.py      the all-gather seam: a process group, or ranks on threads (the fake)
    pieces.py      PieceGather: every rank's owned pieces of some tensors, into every rank's
    optimizer.py   ZeroOptimizer: step, gather, state_dict, full_state_dict
    replicas.py    ReplicaSteps: the replicas a member keeps, stepped as their owners do

    ownership = Ownership.from_layout(make_layout(sizes, members), comm_members)
    zero = ZeroOptimizer(params, optimizer, ownership, GroupGather(group))
    zero.step()                       # after the reduced gradient is in .grad
"""

from keepstep.elastic.zero.gather import Gather, GroupGather, LocalGathers
from keepstep.elastic.zero.optimizer import ZeroOptimizer
from keepstep.elastic.zero.optimizers import ELEMENTWISE
from keepstep.elastic.zero.ownership import ALIGN, Ownership, Window, windows

__all__ = [
    "ALIGN",
    "ELEMENTWISE",
    "Gather",
    "GroupGather",
    "LocalGathers",
    "Ownership",
    "Window",
    "ZeroOptimizer",
    "windows",
]
