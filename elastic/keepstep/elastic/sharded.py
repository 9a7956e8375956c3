"""The job's side of sharded optimizer state (``keepstep.init(..., shard="zero1"|"zero2")``).

Where it sits: between the exact reduction and the commit, in place of the script's
``optimizer.step()`` (job.py ``apply_update``). Per membership epoch the job builds a
``ZeroOptimizer`` (zero/) over the epoch's members: each member steps the elements it
owns, keeps optimizer state for those only, and the parameters are all-gathered over the
epoch's ``Communicator`` (``CommGather``), so a lost peer raises ``PeerLost`` like any
other collective of the step and the step is not committed.

    epoch entered -> restore the snapshot -> epoch_shards(sizes, members, agreed chunks)
      -> ZeroOptimizer(..., ownership of its chunks, CommGather(comm))
      -> each member fetches the pieces its windows need, and (ZeRO-1) the replicas it
         keeps in this epoch (fetch_and_join); the replicas are stepped where they are
         kept (zero/replicas.py), so no commit sends optimizer state
    commit        -> zero.step() -> ZeRO-1: the snapshot keeps this member's pieces and
                     its replicas, nothing sent; ZeRO-2, and ZeRO-1's first commit after
                     a full snapshot (step 0, an unsharded checkpoint): each owner sends its
                     state to the replica holders (exchange_pieces)

ZeRO-2
    With ``shard="zero2"`` the step's exact sum is reduce-scattered instead of all-reduced
    (``reduce``/``finish``, zero/grads.py): a member receives the summed integers of its
    own elements only and turns them into its windows' gradients with the bits the full
    reduction gives them. The shard optimizer holds the gradient, where a grad scaler
    unscales it and ``clip`` clips it with the whole gradient's norm (zero/clip.py). The
    script's hooks read the whole gradient, so a job with them all-gathers it first
    (``grads_for_update``).

Snapshots
    A member's snapshot keeps its own chunks and one replica of another node's, about
    2/W of the state (sharded_snapshot.py). Entering an epoch every member restores its
    snapshot, announces what it holds and needs, and receives only what it lacks, each
    element from one holder, by one ``alltoall`` (``received_bytes``; after a loss, ZeRO-1
    receives what the lost node held). State no member holds is reported (StateMissing)
    on every member. The full state is gathered only on request (``full_state``). Durable
    checkpoints: each member's snapshot is one part (the agent's durable/parts.py), joined
    on resume into one snapshot for a job of any size (sharded_checkpoint.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from keepstep.elastic.comm.rounds import Buffers
from keepstep.elastic.config import Shard
from keepstep.elastic.errors import ConfigError, KeepstepError
from keepstep.elastic.reduce_base import ReduceDone, ReduceOutcome, Settled
from keepstep.elastic.reduce_exact import ExactReducer
from keepstep.elastic.shard.layout import Range
from keepstep.elastic.shard_epoch import EpochShards, agreed_chunks, epoch_shards
from keepstep.elastic.shard_figures import ShardFigures, optimizer_sha256, shard_figures
from keepstep.elastic.sharded_comm import GradCollective, PieceCollective
from keepstep.elastic.sharded_snapshot import (
    exchange_pieces,
    fetch_and_join,
    own_pieces,
    replica_keys,
    snapshot_entries,
    take_pieces,
)
from keepstep.elastic.snapshot_pieces import indexed_values, pack_segments
from keepstep.elastic.snapshot_shard import PieceKey
from keepstep.elastic.zero import ZeroOptimizer
from keepstep.elastic.zero.gather import CommGather, TensorCollective
from keepstep.elastic.zero.grads import GradShard
from keepstep.elastic.zero.optimizers import check_supported
from keepstep.elastic.zero.replicas import ReplicaSteps

log = logging.getLogger(__name__)

__all__ = [
    "CommGather",
    "PieceCollective",
    "ShardFigures",
    "ShardedOptimizer",
    "TensorCollective",
    "optimizer_sha256",
    "shard_figures",
    "sharded_optimizer",
]


class ShardedOptimizer:
    """ZeRO-1 for the job: one ``ZeroOptimizer`` per epoch over the script's optimizer.

    The script's ``optimizer`` stays the front (hooks, LR schedulers, the snapshot's
    param groups). Before the first epoch it holds the full state; a snapshot of a commit
    holds this member's pieces (sharded_snapshot.py), which ``from_snapshot`` takes and
    ``enter`` joins with the other members' into the epoch's shards.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        reducer: ExactReducer | None = None,
    ) -> None:
        # A non-elementwise optimizer is refused here, at init, not at the first step.
        self.keys = check_supported(optimizer)  # its per-element state keys
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:  # the gathers run over one communicator, on one device
            raise ConfigError(
                f"shard= steps parameters on one device; these are on {', '.join(devices)}: "
                "move the model to one device (keepstep.device()) before keepstep.init"
            )
        # ZeRO-2 (a reducer given): the exact sum is reduce-scattered (zero/grads.py).
        self.reducer = reducer
        self.grad_shard: GradShard | None = None
        self._sums: torch.Tensor | None = None  # this member's summed pieces, until finish
        self._grads: list[torch.Tensor | None] | None = None  # its windows' gradients
        self._given: tuple[int, ...] = ()
        self.params = list(params)
        self.optimizer = optimizer
        # Pieces are cut in the optimizer's parameter order (its state_dict's indices).
        mine = [p for g in optimizer.param_groups for p in g["params"]]
        self._sizes = [p.numel() for p in mine]
        self._same_order = [id(p) for p in mine] == [id(p) for p in self.params]
        self.zero: ZeroOptimizer | None = None
        # Exchanged at a commit, for its snapshot: the segments of its payload.
        self._pieces: list[torch.Tensor] | None = None
        # Per rank of the epoch: what it steps and what its snapshots keep (optimizer order).
        self._owners: list[list[Range]] = []
        self._all_holds: list[tuple[Range, ...]] = []
        self._shards: EpochShards | None = None  # the last epoch's: the next is derived from it
        self._keeping: EpochShards | None = None
        job_index = {id(p): t for t, p in enumerate(self.params)}
        self._opt_of = {job_index[id(p)]: i for i, p in enumerate(mine) if id(p) in job_index}
        self._comm: PieceCollective | None = None
        self._buffers = Buffers()  # the epoch's commit buffers (sharded_snapshot.Buffers)
        # ZeRO-1: the replicas this member keeps (fetched at enter, or received at the
        # first commit after a full snapshot), stepped here instead of sent by their owners.
        self._replicas: ReplicaSteps | None = None
        # ZeRO-1: the last `_local` segments (views of the live state) and their values' ids.
        self._segments: tuple[tuple[int, ...], list[torch.Tensor]] | None = None
        self._timeout = timedelta(seconds=60)
        self._restored = b""  # the pieces of the snapshot just restored
        self.enter_s = 0.0  # how long the last `enter` took (the recovery's reshard phase)
        self.received_bytes = 0  # optimizer-state bytes the last `enter` fetched from peers

    def from_snapshot(self, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take this member's pieces out of a restored snapshot's ``extra`` tensors (the
        rest is the reducer's); ``enter`` sends them to the epoch's members."""
        raw = take_pieces(extra)
        self._restored = b"" if raw is None else raw.numpy().tobytes()
        return extra

    @property
    def chunks(self) -> int | None:  # the last epoch's chunk count, for the member's view
        return None if self._shards is None else self._shards.chunks

    def enter(
        self,
        comm: PieceCollective,
        members: Sequence[str],
        timeout: timedelta,
        last_chunks: Sequence[int | None] = (),
    ) -> None:
        """Build the epoch's shards, cut into the chunks agreed from every member's last
        (``last_chunks``, from the views: shard_epoch.agreed_chunks). The job restored the
        snapshot just before: a full one (step 0) left the state in the script's optimizer,
        which the ZeroOptimizer cuts from and clears; one of pieces left them here, and each
        member fetches the pieces its windows (and, ZeRO-1, its replicas) need from their
        holders (a collective: ``StateMissing`` if an element has no live copy)."""
        self.leave()
        started = time.perf_counter()
        chunks = agreed_chunks(members, last_chunks, sum(self._sizes))
        shards = epoch_shards([p.numel() for p in self.params], members, self._shards, chunks)
        self.zero = ZeroOptimizer(
            self.params,
            self.optimizer,
            shards.ownership(members),
            CommGather(comm),
            timeout=timeout,
        )
        if self.reducer is not None:  # ZeRO-2: the plan of the step's reduce-scatter
            lo = self.reducer.offsets
            self.grad_shard = GradShard(self.zero.ownership, lo, self.zero.windows, comm.rank)
        # Snapshots cut pieces in the optimizer's parameter order: the same shards when
        # that is the job's order (the usual case), so a member keeps its own chunks.
        keeping = (
            shards
            if self._same_order
            else epoch_shards(self._sizes, members, self._keeping, chunks)
        )
        self._shards, self._keeping = shards, keeping
        self._all_holds = [keeping.held[m] for m in members]
        offsets = [0, *accumulate(self._sizes)]
        at = {t: offsets[i] for t, i in self._opt_of.items()}
        self._owners = [
            [Range(at[t] + a, at[t] + b) for t, a, b in self.zero.ownership.pieces(r) if t in at]
            for r in range(comm.size)
        ]
        self._comm, self._timeout, self._buffers = comm, timeout, Buffers()
        windows = [PieceKey(*w) for w in self.zero.needed()]
        mine, self._restored = self._restored, b""
        holds, owned = self._all_holds[comm.rank], self._owners[comm.rank]
        # ZeRO-1 steps its replicas; ZeRO-2 lacks the others' gradients to step them with.
        replicas = replica_keys(holds, owned, self._sizes) if self.reducer is None else []
        built = time.perf_counter()
        got = fetch_and_join(comm, mine, windows, self._sizes, self.keys, timeout, replicas)
        fetched = time.perf_counter()
        if got.state is not None:
            groups = self.optimizer.state_dict()["param_groups"]
            self.zero.load_window_states(got.state, groups)
            if self.reducer is None:
                self._replicas = ReplicaSteps(self.optimizer, got.replicas, self.keys)
        self.received_bytes = got.received_bytes
        self.enter_s = time.perf_counter() - started
        log.info(
            "epoch shards (%d chunks) in %.3f s: layout and shard optimizer %.3f s, fetch and "
            "join %.3f s (%d B received), load %.3f s",
            *(chunks, self.enter_s, built - started, fetched - built),
            *(got.received_bytes, self.enter_s - (fetched - started)),
        )

    def set_weights(self, weights: Mapping[str, float] | None) -> None:
        """The plan's weights (member -> relative speed; None: equal, balance.py) for the
        work the shard does whole on one member (Muon's Newton-Schulz, ZeRO-2's norms):
        given when an epoch is entered and at each replan, the same on every member, so a
        member the plan gives fewer micro-batches gets less of it too."""
        if self.zero is None or self._comm is None:
            return
        speeds = None if not weights else [weights[m] for m in self._comm.members]
        self.zero.set_speeds(speeds)

    def state_bytes(self) -> int:
        """Optimizer-state bytes this member holds now: its shard's and, for ZeRO-1, the
        replicas it steps (0 outside an epoch)."""
        if self.zero is None:
            return 0
        replicas = 0 if self._replicas is None else self._replicas.state_bytes()
        return self.zero.state_bytes() + replicas

    def stepped_elements(self) -> int | None:
        """How many of the optimizer's elements this member steps in the epoch (None:
        outside an epoch)."""
        return None if self.zero is None else self.zero.ownership.owned(self.zero.rank)

    def leave(self) -> None:
        """Drop the epoch's shards (its communicator is closed)."""
        self.zero = self._comm = None
        self._pieces = self._replicas = self._segments = None
        self.grad_shard, self._sums, self._grads = None, None, None

    # -- ZeRO-2: the reduction ----------------------------------------------------------
    @property
    def scatters(self) -> bool:
        """True for ZeRO-2: the step's sum is reduce-scattered, not all-reduced."""
        return self.reducer is not None

    def reduce(self, comm: GradCollective, buffer: torch.Tensor, timeout: timedelta) -> None:
        """ZeRO-2's exchange of the exact reducer's ``buffer``: its tail (counts, peaks,
        the caller's slots) all-reduced in place, its data reduce-scattered to the owners
        (both collectives: ``PeerLost`` fails the step)."""
        if self.grad_shard is None:
            raise ConfigError("the sharded reduction runs only inside an epoch")
        self._sums = self._grads = None
        n = self.grad_shard.data_size
        comm.allreduce(buffer[n:], dist.ReduceOp.SUM, timeout)
        self._sums = self.grad_shard.reduce(comm, buffer[:n], timeout)

    def finish(
        self,
        buffer: torch.Tensor,
        n_micro: int,
        params: Sequence[torch.Tensor],
        total_weight: int | None = None,
    ) -> ReduceOutcome:
        """What ``ExactReducer.finish`` is to the all-reduced buffer, for this member's
        pieces: the outcome, and on success its windows' averaged gradients (kept for
        ``step``; every ``.grad`` is None)."""
        assert self.reducer is not None and self.grad_shard is not None and self._sums is not None
        settled = self.reducer.settle(buffer[self.grad_shard.data_size :], n_micro, total_weight)
        sums, self._sums = self._sums, None
        if not isinstance(settled, Settled):
            return settled
        self._grads = self.grad_shard.window_grads(sums, settled, params)
        self._given = settled.given
        for p in params:
            p.grad = None
        return ReduceDone()

    def clips_windows(self) -> bool:
        """Whether ``clip`` clips this step's gradient where it is: ZeRO-2's windows, when
        every tensor with a gradient is the optimizer's (else it is gathered to clip)."""
        if self.reducer is None or self.zero is None:
            return False
        return all(t in self.zero.stepped for t, n in enumerate(self._given) if n > 0)

    def clip(self, max_norm: float) -> float:
        """ZeRO-2: clip the windows' gradient as ``clip_grad_norm_`` clips the whole, with
        its bits (zero/clip.py); the total norm. A collective."""
        assert self.zero is not None, "clip runs inside an epoch"
        return float(self.zero.clip_attached(max_norm))

    def grads_for_update(self, front: torch.optim.Optimizer, whole: bool) -> torch.optim.Optimizer:
        """Where the step's gradient is for the update; ZeRO-1: in ``.grad``, as unsharded.
        ZeRO-2: this member's windows' gradients go to the shard optimizer, which is
        returned (a grad scaler unscales them there, ``clip`` clips them there); with
        ``whole`` (hooks, or clipping a gradient of tensors the optimizer does not step,
        read the whole gradient) they are all-gathered into ``.grad`` first (a collective:
        ``PeerLost`` fails the step), and the step reads them as ZeRO-1's."""
        grads, self._grads = self._grads, None
        if self.reducer is None:
            return front
        assert self.zero is not None and grads is not None, "finish gives the gradient"
        if whole:
            self.zero.gather_grads(grads, self._given)
            return front
        self.zero.attach_grads(grads, self._given)
        return self.zero.inner

    def step(self) -> None:
        """The sharded step and the snapshot's pieces (collectives: ``PeerLost`` leaves the
        step uncommitted, and the job restores its snapshot)."""
        if self.zero is None:
            raise ConfigError("the sharded optimizer steps only inside an epoch")
        self._pieces = None
        if self._replicas is not None:  # before the owners' step changes the parameters
            self._replicas.step()
        self.zero.step()
        self._pieces = self._exchange() if self._replicas is None else self._local()

    def skip(self) -> None:
        """A step committed without an optimizer step (the loss scale backs off): the state
        does not change, and its pieces are exchanged for the snapshot as after a step."""
        if self.zero is None:
            raise ConfigError("the sharded optimizer skips only inside an epoch")
        self._pieces = None
        self._pieces = self._exchange() if self._replicas is None else self._local()

    def _own_state(self) -> dict[PieceKey, Any]:
        """The pieces this member steps, keyed in the optimizer's parameter order."""
        assert self.zero is not None
        sd, index = self.zero.state_dict(), self._opt_of
        return {
            PieceKey(index[t], a, b): sd["state"].get(i, {})
            for i, (t, a, b) in enumerate(sd["pieces"])
        }

    def _exchange(self) -> list[torch.Tensor]:
        """This member's snapshot pieces: its own state, and the replicas it keeps from
        their owners (sharded_snapshot.exchange_pieces; no member gathers the full state).
        ZeRO-1 keeps the replicas it received, to step them from the next commit on."""
        assert self._comm is not None
        own, received = exchange_pieces(
            self._comm,
            self._own_state(),
            self._owners,
            self._all_holds,
            self._sizes,
            self.keys,
            self._timeout,
            self._buffers,
        )
        if self.reducer is None:  # ZeRO-1: every member holds the whole gradient
            # The replicas are what the peers sent (each piece once and none of this
            # member's own: the exchange checks it), read in place: ReplicaSteps copies.
            kept = {
                k: v
                for payload in received
                for k, v in indexed_values(payload, self._sizes, self.keys).items()
            }
            self._replicas = ReplicaSteps(self.optimizer, kept, self.keys)
            self._buffers = Buffers()  # no more exchanges this epoch (the segments hold theirs)
        return pack_segments(own, received)

    def _local(self) -> list[torch.Tensor]:
        """ZeRO-1 with its replicas: this member's own pieces and the replicas it stepped,
        as the exchange would have given them, with nothing sent. Segments view
        the state, which the optimizers update in place: while it holds the same value
        objects, the last commit's segments read this one's values (not cut again)."""
        assert self._comm is not None and self._replicas is not None and self.zero is not None
        states = (*self.zero.inner.state.values(), *self._replicas.inner.state.values())
        values = [v for state in states for v in state.values()]
        # A plain value (not a tensor) sits in the header itself: then cut every time.
        ids = tuple(map(id, values)) if all(isinstance(v, torch.Tensor) for v in values) else ()
        if ids and self._segments is not None and self._segments[0] == ids:
            return list(self._segments[1])
        own = own_pieces(
            self._own_state(),
            self._owners,
            self._all_holds,
            self._sizes,
            self.keys,
            self._comm.rank,
        )
        segments = pack_segments({**own, **self._replicas.pieces()})
        self._segments = (ids, segments) if ids else None  # holding them keeps the ids unique
        return list(segments)

    def for_snapshot(
        self, extra: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The snapshot's ``extra`` tensors and optimizer state: this member's pieces of the
        state exchanged at the last commit (own chunks and replicas, ~2/W of it) and the
        param groups. Before the first epoch: the script's optimizer holds the full state,
        and the snapshot takes it as it is."""
        pieces, self._pieces = self._pieces, None
        if pieces is None:
            if self.zero is not None:  # the script's optimizer holds nothing now
                raise KeepstepError("a sharded snapshot needs the pieces its commit exchanged")
            return dict(extra), None
        groups = self.optimizer.state_dict()["param_groups"]
        return {**extra, **snapshot_entries(pieces)}, {"state": {}, "param_groups": groups}

    def full_state(self) -> dict[str, Any] | None:
        """The full optimizer state, gathered now (a collective of the epoch); None outside
        an epoch."""
        return None if self.zero is None else self.zero.full_state_dict()


def sharded_optimizer(
    shard: Shard | None,
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    reducer: object,
) -> ShardedOptimizer | None:
    """The job's sharded optimizer for ``JobConfig.shard``; None for full replicas.
    ZeRO-2 reduce-scatters the exact mode's sum, so it needs the exact ``reducer``."""
    if shard is None:
        return None
    if shard is Shard.ZERO1:
        return ShardedOptimizer(params, optimizer)
    if not isinstance(reducer, ExactReducer):
        raise ConfigError(f"shard={shard.value!r} needs mode='exact': its sum is reduce-scattered")
    return ShardedOptimizer(params, optimizer, reducer)
