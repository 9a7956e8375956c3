"""The job's side of sharded optimizer state (``keepstep.init(..., shard="zero1")``).

Where it sits: between the exact reduction and the commit, in place of the script's
``optimizer.step()`` (job.py ``apply_update``). Per membership epoch the job builds a
``ZeroOptimizer`` (zero/) over the epoch's members: each member steps the elements it
owns, keeps optimizer state for those only, and the parameters are all-gathered over the
epoch's ``Communicator`` (``CommGather``), so a lost peer raises ``PeerLost`` like any
other collective of the step and the step is not committed.

    epoch entered -> restore the snapshot -> epoch_shards(sizes, members)
      -> ZeroOptimizer(..., ownership of its chunks, CommGather(comm))
      -> each member fetches the pieces its windows need (fetch_and_join)
    each commit   -> zero.step() -> gather the full state -> keep this member's pieces

Layout
    Every epoch cuts the state into the same chunks and owns them by the chunked layout
    (shard_epoch.py, shard/chunks.py): after a node is lost, the owner of each lost chunk
    is (mostly) the member that kept its replica, so recovery moves little more than the
    lost chunks' replicas that their new owners lack (``tests/elastic/test_shard_fetch.py``
    bounds it by the lost elements).

Snapshots
    A commit gathers the full optimizer state (one all-gather), and the snapshot keeps
    this member's pieces of it: its own chunks and one replica of another node's, about
    2/W of the state (sharded_snapshot.py). Entering an epoch (a loss, a drain, a join,
    a rollback) every member restores its snapshot, announces what it holds and what its
    windows need, and receives only what it lacks, each element from one holder, by one
    ``alltoall`` (``received_bytes`` counts it): any single-node loss leaves a live copy
    of every element; a double fault is reported (StateShapeError) on every member.
    Between steps a member holds only its shard's optimizer state (about 1/W, plus window
    scratch); the full state exists while a commit gathers it. Not yet: stepping and
    snapshotting without the gather.

Durable checkpoints
    Every member's snapshot of a step goes to storage as one part, in parallel (the
    agent's durable/parts.py); a resume joins the parts into one snapshot
    (sharded_checkpoint.py) that seeds every member of a job of any size.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from itertools import accumulate
from typing import Any, Protocol, TypedDict

import torch

from keepstep.elastic.config import Shard
from keepstep.elastic.errors import BadMessage, ConfigError, KeepstepError
from keepstep.elastic.shard.layout import Range
from keepstep.elastic.shard_epoch import epoch_shards
from keepstep.elastic.sharded_snapshot import (
    PIECES,
    fetch_and_join,
    pieces_tensor,
)
from keepstep.elastic.zero import Ownership, ZeroOptimizer
from keepstep.elastic.zero.optimizers import check_supported

__all__ = [
    "BytesCollective",
    "CommGather",
    "PieceCollective",
    "ShardFigures",
    "ShardedOptimizer",
    "optimizer_sha256",
    "ownership_for",
    "shard_figures",
    "sharded_optimizer",
]


class BytesCollective(Protocol):
    """What ``CommGather`` needs of the epoch's ``Communicator`` (its public methods)."""

    rank: int
    size: int
    members: tuple[str, ...]

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]: ...


class PieceCollective(BytesCollective, Protocol):
    """What entering an epoch needs of the ``Communicator``: the gather and ``alltoall``."""

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]: ...


class CommGather:
    """``zero.Gather`` over ``Communicator.allgather_bytes``: the epoch's abort handling
    (``PeerLost``, the abort key) covers ZeRO's all-gathers too. Tensors travel as their
    raw bytes (never converted, never pickled) and come back with the sender's shape and
    dtype, which every rank shares by the Gather contract (checked by length)."""

    def __init__(self, comm: BytesCollective) -> None:
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def allgather(self, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        if not isinstance(mine, torch.Tensor) or mine.device.type != "cpu":
            raise ConfigError("CommGather.allgather needs a CPU tensor")
        raw = mine.detach().contiguous().reshape(-1).view(torch.uint8)
        payload = raw.numpy().tobytes()
        slots = self.comm.allgather_bytes(payload, max(len(payload), 1), timeout)
        out = []
        for rank, slot in enumerate(slots):
            if len(slot) != len(payload):
                raise BadMessage(f"rank {rank} sent {len(slot)} bytes, {len(payload)} expected")
            flat = torch.frombuffer(bytearray(slot), dtype=torch.uint8) if slot else raw[:0]
            out.append(flat.clone().view(mine.dtype).reshape(mine.shape))
        return out


def ownership_for(sizes: Sequence[int], members: Sequence[str]) -> Ownership:
    """Who owns which elements in the epoch of ``members`` (sorted: the communicator's rank
    order): the chunks of ``epoch_shards``, many ranges per member, each starting on an
    ``ALIGN`` boundary of its tensor so windows are the pieces themselves."""
    return epoch_shards(sizes, members).ownership(members)


class ShardedOptimizer:
    """ZeRO-1 for the job: one ``ZeroOptimizer`` per epoch over the script's optimizer.

    The script's ``optimizer`` stays the front (hooks, LR schedulers, the snapshot's
    param groups). Before the first epoch it holds the full state; a snapshot of a commit
    holds this member's pieces (sharded_snapshot.py), which ``from_snapshot`` takes and
    ``enter`` joins with the other members' into the epoch's shards.
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        # A non-elementwise optimizer is refused here, at init, not at the first step.
        self.keys = check_supported(optimizer)  # its per-element state keys
        self.params = list(params)
        self.optimizer = optimizer
        # Pieces are cut in the optimizer's parameter order (its state_dict's indices).
        mine = [p for g in optimizer.param_groups for p in g["params"]]
        self._sizes = [p.numel() for p in mine]
        self._shapes = [p.shape for p in mine]
        self._same_order = [id(p) for p in mine] == [id(p) for p in self.params]
        self.zero: ZeroOptimizer | None = None
        self._full: dict[str, Any] | None = None  # gathered at a commit, until its snapshot
        self._holds: tuple[Range, ...] = ()  # what this member's snapshots keep
        self._restored = b""  # the pieces of the snapshot just restored
        self.enter_s = 0.0  # how long the last `enter` took (the recovery's reshard phase)
        self.received_bytes = 0  # optimizer-state bytes the last `enter` fetched from peers

    def from_snapshot(self, extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take this member's pieces out of a restored snapshot's ``extra`` tensors (the
        rest is the reducer's); ``enter`` sends them to the epoch's members."""
        raw = extra.pop(PIECES, None)
        self._restored = b"" if raw is None else raw.numpy().tobytes()
        return extra

    def enter(self, comm: PieceCollective, members: Sequence[str], timeout: timedelta) -> None:
        """Build the epoch's shards. The job restored the snapshot just before: a full one
        (step 0) left the state in the script's optimizer, which the ZeroOptimizer cuts
        from and clears; one of pieces left them here, and each member fetches the pieces
        its windows need from their holders (a collective: ``StateShapeError`` if an
        element has no live copy)."""
        self.leave()
        started = time.perf_counter()
        shards = epoch_shards([p.numel() for p in self.params], members)
        self.zero = ZeroOptimizer(
            self.params,
            self.optimizer,
            shards.ownership(members),
            CommGather(comm),
            timeout=timeout,
        )
        # Snapshots cut pieces in the optimizer's parameter order: the same shards when
        # that is the job's order (the usual case), so a member keeps its own chunks.
        keeping = shards if self._same_order else epoch_shards(self._sizes, members)
        self._holds = keeping.held[members[comm.rank]]
        offsets = [0, *accumulate(self._sizes)]
        need = [Range(offsets[i] + a, offsets[i] + b) for i, a, b in self.zero.needed()]
        mine, self._restored = self._restored, b""
        got = fetch_and_join(comm, mine, need, self._sizes, self.keys, self._shapes, timeout)
        if got.state is not None:
            groups = self.optimizer.state_dict()["param_groups"]
            self.zero.load_full_state_dict({"state": got.state, "param_groups": groups})
        self.received_bytes = got.received_bytes
        self.enter_s = time.perf_counter() - started

    def stepped_elements(self) -> int | None:
        """How many of the optimizer's elements this member steps in the epoch (None:
        outside an epoch)."""
        return None if self.zero is None else self.zero.ownership.owned(self.zero.rank)

    def leave(self) -> None:
        """Drop the epoch's shards (its communicator is closed)."""
        self.zero = None
        self._full = None

    def step(self) -> None:
        """The sharded step, then the full state for the snapshot (both collectives:
        ``PeerLost`` leaves the step uncommitted, and the job restores its snapshot)."""
        if self.zero is None:
            raise ConfigError("the sharded optimizer steps only inside an epoch")
        self._full = None
        self.zero.step()
        self._full = self.zero.full_state_dict()

    def skip(self) -> None:
        """A step committed without an optimizer step (the loss scale backs off): the state
        does not change, and is gathered for the snapshot as after a step (a collective)."""
        if self.zero is None:
            raise ConfigError("the sharded optimizer skips only inside an epoch")
        self._full = None
        self._full = self.zero.full_state_dict()

    def for_snapshot(
        self, extra: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The snapshot's ``extra`` tensors and optimizer state: this member's pieces of the
        state gathered at the last commit (own chunks and replicas, ~2/W of it) and the
        param groups; the gathered state is dropped here. Before the first epoch: the
        script's optimizer holds the full state, and the snapshot takes it as it is."""
        full, self._full = self._full, None
        if full is None:
            if self.zero is not None:  # the script's optimizer holds nothing now
                raise KeepstepError("a sharded snapshot needs the state its commit gathered")
            return dict(extra), None
        pieces = pieces_tensor(full, self._sizes, self.keys, self._holds)
        return {**extra, PIECES: pieces}, {"state": {}, "param_groups": full["param_groups"]}

    def full_state(self) -> dict[str, Any] | None:
        """The full optimizer state, gathered now (a collective of the epoch); None outside
        an epoch."""
        return None if self.zero is None else self.zero.full_state_dict()


def sharded_optimizer(
    shard: Shard | None, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
) -> ShardedOptimizer | None:
    """The job's sharded optimizer for ``JobConfig.shard``; None for full replicas."""
    if shard is None:
        return None
    assert shard is Shard.ZERO1, shard  # JobConfig allows no other
    return ShardedOptimizer(params, optimizer)


class ShardFigures(TypedDict):
    """What entering an epoch measured of the sharded state (a `Reconfiguration`'s fields)."""

    stepped_elements: int | None
    reshard_s: float
    reshard_bytes: int


def shard_figures(sharded: ShardedOptimizer | None) -> ShardFigures:
    """The epoch's figures of ``sharded`` (None: full replicas)."""
    if sharded is None:
        return {"stepped_elements": None, "reshard_s": 0.0, "reshard_bytes": 0}
    return {
        "stepped_elements": sharded.stepped_elements(),
        "reshard_s": sharded.enter_s,
        "reshard_bytes": sharded.received_bytes,
    }


def optimizer_sha256(state: Mapping[str, Any]) -> str:
    """sha256 over an optimizer state dict: per parameter index in order, each key's
    values (tensors by dtype, shape and bytes), then the param groups' hyper-parameters.
    The same for the gathered state of a sharded job and the full optimizer's."""
    digest = hashlib.sha256()
    for index in sorted(state["state"]):
        per_param = state["state"][index]
        digest.update(f"param {index}".encode())
        for key in sorted(per_param):
            digest.update(key.encode())
            _feed(digest, per_param[key])
    for group in state["param_groups"]:
        for key in sorted(group):
            digest.update(key.encode())
            _feed(digest, group[key])
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        raw = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(raw.numpy().tobytes())
    else:
        digest.update(repr(value).encode())
