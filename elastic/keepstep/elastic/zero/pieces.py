"""Every rank's pieces of some tensors, all-gathered into every rank's copies.

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) runs three such gathers over its
``Gather`` (zero/gather.py): the updated parameters after every step, the window
gradients for a job that reads the whole gradient (ZeRO-2 with clipping), and Muon's
momentum updates before the whole-matrix step (zero/muon.py). Each names the tensors it
moves. A rank sends its owned pieces of them, in flattened order, except for tensors
given ``whole``: each of those is sent entire by the one rank named for it (Muon's
matrices, stepped whole on one rank). What every rank sends is computed once per such
request from the ownership, which every rank computes alike, so the slots need no
header. One send buffer is kept for the epoch, warm gather after gather.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch

from keepstep.elastic.shard.layout import Piece
from keepstep.elastic.zero.gather import Gather
from keepstep.elastic.zero.ownership import Ownership

__all__ = ["PieceGather"]

_Plan = tuple[list[list[Piece]], list[int]]
_NONE: Mapping[int, int] = {}


class PieceGather:
    """All-gathers of pieces over ``gather``'s ranks, for tensors whose elements are
    ``element_sizes[t]`` bytes each and whose owners ``ownership`` says."""

    def __init__(self, gather: Gather, ownership: Ownership, element_sizes: Sequence[int]):
        self.gather = gather
        self.ownership = ownership
        self.element_sizes = list(element_sizes)
        self._plans: dict[tuple[frozenset[int], tuple[tuple[int, int], ...]], _Plan] = {}
        self._mine: torch.Tensor | None = None  # this rank's bytes of a gather

    def plan(self, which: frozenset[int], whole: Mapping[int, int] = _NONE) -> _Plan:
        """Per rank, the pieces it sends of the tensors ``which`` and their length in
        bytes: its owned pieces, and all of each tensor ``t`` with ``whole[t]`` its rank."""
        key = (which, tuple(sorted((t, r) for t, r in whole.items() if t in which)))
        plan = self._plans.get(key)
        if plan is None:
            sends = []
            for r in range(self.ownership.world):
                mine = [pc for pc in self.ownership.pieces(r) if pc.tensor in which]
                mine = [pc for pc in mine if pc.tensor not in whole]
                mine += [Piece(t, 0, self.ownership.sizes[t]) for t, o in key[1] if o == r]
                sends.append(sorted(mine))
            lengths = [sum((b - a) * self.element_sizes[t] for t, a, b in mine) for mine in sends]
            plan = self._plans[key] = (sends, lengths)
        return plan

    def run(
        self,
        flat_bytes: Callable[[int], torch.Tensor],
        which: frozenset[int],
        timeout: timedelta,
        *,
        whole: Mapping[int, int] = _NONE,
        into: frozenset[int] | None = None,
        source: Callable[[Piece], torch.Tensor] | None = None,
    ) -> None:
        """Every rank's pieces (``plan``) of the tensors ``flat_bytes(t)`` for ``t`` in
        ``which`` (1-D bytes of the whole tensor), written into this rank's; only those of
        the tensors ``into`` when given. What this rank sends comes from ``source(piece)``
        when given (the piece's bytes), else from ``flat_bytes``; ``flat_bytes`` is asked
        for no tensor it need not give. A collective: every rank calls it with the same
        ``which`` and ``whole``; ``PeerLost`` if a rank fails."""
        if self.ownership.world == 1:
            return
        sends, lengths = self.plan(which, whole)
        rank = self.gather.rank
        receive = which if into is None else into & which
        sent = set() if source is not None else {t for t, _, _ in sends[rank]}
        tensors = {t: flat_bytes(t) for t in sorted(sent | receive)}
        size = self.element_sizes

        def bytes_of(piece: Piece) -> torch.Tensor:
            t, a, b = piece
            return tensors[t][a * size[t] : b * size[t]]

        length = max(max(lengths), 1)  # every rank sends a slot of one size
        if self._mine is None or self._mine.numel() < length:
            self._mine = torch.zeros(length, dtype=torch.uint8, device=self.gather.device)
        mine = self._mine[:length]
        if lengths[rank]:
            torch.cat([(source or bytes_of)(pc) for pc in sends[rank]], out=mine[: lengths[rank]])
        slots = self.gather.allgather(mine, timeout)
        for r, slot in enumerate(slots):
            if r == rank or not lengths[r]:
                continue
            into_r, parts_r = [], []
            at = 0
            for t, a, b in sends[r]:
                n = (b - a) * size[t]
                if t in receive:
                    into_r.append(tensors[t][a * size[t] : b * size[t]])
                    parts_r.append(slot[at : at + n])
                at += n
            if into_r:
                torch._foreach_copy_(into_r, parts_r)
