"""ZeRO-2: the exact sum reduce-scattered, each member keeping the gradient of its shard.

Where it sits: in place of the all-reduce of the exact reducer's buffer when the job runs
``shard="zero2"`` (sharded.py, step.py). The buffer's data region holds every tensor's
fixed-point integers (reduce_exact.py); here each member's owned pieces of it are packed
into one slot per rank, the slots are reduce-scattered (a SUM over members of integers
held in float64: exact, so any order of additions gives the same bits), and each member
turns its slot into the averaged gradient of its windows, as the unsharded finish does:
``sum / divisor`` in float64, rounded to the parameter's dtype. Every element therefore
gets the bits the full reduction gives it, and no member holds another's gradient.

    shard = GradShard(ownership, reducer.offsets, windows, rank)
    sums = shard.reduce(comm, buffer[:data_size], timeout)     # this member's pieces
    settled = reducer.settle(all-reduced tail, n_micro)         # divisors, given
    grads = shard.window_grads(sums, settled, params)           # one per window

Scratch lanes of a window (zero/ownership.py) get a zero gradient: they are stepped for
the kernels' alignment only, and the all-gather overwrites them with their owner's copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch

from keepstep.elastic.comm.rounds import Alloc, Buffers
from keepstep.elastic.errors import ConfigError, StateShapeError
from keepstep.elastic.reduce_base import Settled
from keepstep.elastic.zero.ownership import Ownership, Window

__all__ = ["GradShard", "ReduceScatter"]


class ReduceScatter(Protocol):
    """What ``GradShard.reduce`` needs of the epoch's ``Communicator``."""

    rank: int
    size: int

    def reduce_scatter(
        self, tensor: torch.Tensor, timeout: timedelta | None = None, into: Alloc | None = None
    ) -> torch.Tensor: ...


class GradShard:
    """One epoch's reduce-scatter plan of the exact buffer, for rank ``rank``.

    ``offsets``: where each tensor's integers start in the buffer's data region, then
    where the data ends (``ExactReducer.offsets``); ``windows``: the windows this rank
    steps (``ZeroOptimizer.windows``), whose owned pieces are this rank's pieces.
    """

    def __init__(
        self, ownership: Ownership, offsets: Sequence[int], windows: Sequence[Window], rank: int
    ) -> None:
        if len(offsets) != len(ownership.sizes) + 1:
            raise ConfigError(
                f"offsets has {len(offsets)} entries; {len(ownership.sizes) + 1} expected "
                "(one per tensor, then the data's end)"
            )
        if not 0 <= rank < ownership.world:
            raise ConfigError(f"rank={rank} is outside [0, {ownership.world})")
        self.rank, self.world = rank, ownership.world
        self.data_size = offsets[-1]
        # Per rank, the buffer slices of its pieces, in its flattened order.
        self._slices = [
            [(offsets[t] + a, offsets[t] + b) for t, a, b in ownership.pieces(r) if b > a]
            for r in range(self.world)
        ]
        self.counts = [sum(b - a for a, b in mine) for mine in self._slices]
        self.width = max(max(self.counts), 1)  # every slot padded to the longest
        where, at = {}, 0
        for t, a, b in ownership.pieces(rank):
            where[(t, a)] = at
            at += b - a
        self._where = where
        # Kept for the epoch (one plan per epoch: a given-up reduction may still use them):
        # written warm step after step, where fresh ones are faulted in page by page.
        self._send: torch.Tensor | None = None
        self._received = Buffers()
        self._windows = list(windows)
        for w in self._windows:
            for r in w.owned:
                if r.stop > r.start and (w.tensor, r.start) not in where:
                    raise ConfigError(
                        f"window of tensor {w.tensor} owns [{r.start}, {r.stop}), which is not "
                        f"a piece of rank {rank}"
                    )

    def reduce(self, comm: ReduceScatter, data: torch.Tensor, timeout: timedelta) -> torch.Tensor:
        """This rank's pieces of ``data`` (the buffer's data region) summed over every
        member: a collective (``PeerLost`` when a peer is lost). Float64, in the order of
        ``ownership.pieces(rank)``; a view of a buffer the plan keeps, valid until the next
        ``reduce``."""
        if comm.size != self.world or comm.rank != self.rank:
            raise ConfigError(
                f"the communicator is rank {comm.rank} of {comm.size}; the plan is rank "
                f"{self.rank} of {self.world}"
            )
        if data.dtype != torch.float64 or data.shape != (self.data_size,):
            raise StateShapeError(
                f"data is {data.dtype} {tuple(data.shape)}; float64 ({self.data_size},) expected"
            )
        send = self._send
        if send is None or send.device != data.device:  # zeroed once: the pads stay zero
            n = self.world * self.width
            send = self._send = torch.zeros(n, dtype=torch.float64, device=data.device)
        for r, mine in enumerate(self._slices):
            if mine:
                slot = send[r * self.width : r * self.width + self.counts[r]]
                torch.cat([data[a:b] for a, b in mine], out=slot)
        into = self._received.alloc("slices", data.device)
        out = comm.reduce_scatter(send, timeout, into)
        return out[: self.counts[self.rank]]

    def window_grads(
        self, sums: torch.Tensor, settled: Settled, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """The averaged gradient of every window (1-D, the window's length, the
        parameter's dtype): None for a tensor no micro-batch gave a gradient, as the
        unsharded reduction leaves its ``.grad``."""
        if sums.shape != (self.counts[self.rank],):
            raise StateShapeError(
                f"sums has shape {tuple(sums.shape)}; ({self.counts[self.rank]},) expected"
            )
        out: list[torch.Tensor | None] = []
        for w in self._windows:
            if settled.given[w.tensor] <= 0:
                out.append(None)
                continue
            p = params[w.tensor]
            grad = torch.zeros(w.stop - w.start, dtype=p.dtype, device=p.device)
            divisor = settled.divisors[w.tensor]
            for r in w.owned:
                if r.stop > r.start:
                    at = self._where[(w.tensor, r.start)]
                    part = sums[at : at + r.stop - r.start]
                    grad[r.start - w.start : r.stop - w.start].copy_(part / divisor)
            out.append(grad)
        return out
