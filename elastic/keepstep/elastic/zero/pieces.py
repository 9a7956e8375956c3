"""Every rank's owned pieces of some tensors, all-gathered into every rank's copies.

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) runs three such gathers over its
``Gather`` (zero/gather.py): the updated parameters after every step, the window
gradients for a job that reads the whole gradient (ZeRO-2 with clipping), and Muon's
momentum updates before the whole-matrix step (zero/muon.py). Each names the tensors it
moves; what every rank sends of them (its owned pieces, in flattened order) is computed
once per set of tensors from the ownership, which every rank computes alike, so the
slots need no header. One send buffer is kept for the epoch, warm gather after gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from keepstep.elastic.shard.layout import Piece
from keepstep.elastic.zero.gather import Gather
from keepstep.elastic.zero.ownership import Ownership

__all__ = ["PieceGather"]

_Plan = tuple[list[list[Piece]], list[int]]


class PieceGather:
    """All-gathers of owned pieces over ``gather``'s ranks, for tensors whose elements
    are ``element_sizes[t]`` bytes each and whose owners ``ownership`` says."""

    def __init__(self, gather: Gather, ownership: Ownership, element_sizes: Sequence[int]):
        self.gather = gather
        self.ownership = ownership
        self.element_sizes = list(element_sizes)
        self._plans: dict[frozenset[int], _Plan] = {}
        self._mine: torch.Tensor | None = None  # this rank's bytes of a gather

    def plan(self, which: frozenset[int]) -> _Plan:
        """Per rank, its owned pieces of the tensors ``which`` and their length in bytes."""
        plan = self._plans.get(which)
        if plan is None:
            sends = [
                [pc for pc in self.ownership.pieces(r) if pc.tensor in which]
                for r in range(self.ownership.world)
            ]
            lengths = [sum((b - a) * self.element_sizes[t] for t, a, b in mine) for mine in sends]
            plan = self._plans[which] = (sends, lengths)
        return plan

    def run(
        self,
        flat_bytes: Callable[[int], torch.Tensor],
        which: frozenset[int],
        timeout: timedelta,
    ) -> None:
        """Every rank's owned pieces of the tensors ``flat_bytes(t)`` for ``t`` in
        ``which`` (1-D bytes of the whole tensor), into this rank's. A collective: every
        rank calls it with the same ``which``; ``PeerLost`` if a rank fails."""
        if self.ownership.world == 1:
            return
        sends, lengths = self.plan(which)
        tensors = {t: flat_bytes(t) for t in which}

        def views(r: int) -> list[torch.Tensor]:  # rank r's pieces, as bytes of the tensors
            size = self.element_sizes
            return [tensors[t][a * size[t] : b * size[t]] for t, a, b in sends[r]]

        length = max(max(lengths), 1)  # every rank sends a slot of one size
        if self._mine is None or self._mine.numel() < length:
            self._mine = torch.zeros(length, dtype=torch.uint8, device=self.gather.device)
        mine = self._mine[:length]
        rank = self.gather.rank
        if lengths[rank]:
            torch.cat(views(rank), out=mine[: lengths[rank]])
        slots = self.gather.allgather(mine, timeout)
        for r, slot in enumerate(slots):
            if r != rank and lengths[r]:
                into = views(r)
                parts = torch.split(slot[: lengths[r]], [v.numel() for v in into])
                torch._foreach_copy_(into, list(parts))
