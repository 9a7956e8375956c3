"""Every rank's pieces of some tensors, all-gathered into every rank's copies.

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) runs two such gathers over its
``Gather`` (zero/gather.py): the updated parameters after every step, and the window
gradients for a job that reads the whole gradient (ZeRO-2 with clipping). Each names the
tensors it moves. A rank sends its owned pieces of them, in flattened order, except for tensors
given ``whole``: each of those is sent entire by the one rank named for it (Muon's
matrices, stepped whole on one rank). What every rank sends is computed once per such
request from the ownership, which every rank computes alike, so the slots need no
header. One send buffer is kept for the epoch, warm gather after gather.

``send_to`` is the all-to-all beside it: each tensor's owned pieces go to one rank only
(Muon's momentum updates, to the rank that steps the matrix: zero/matrices.py), so each
rank receives about 1/W of them where an all-gather would bring it all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta

import torch

from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.shard.layout import Piece
from keepstep.elastic.zero.gather import Gather
from keepstep.elastic.zero.ownership import Ownership, Window

__all__ = ["PieceGather", "assign_whole", "check_speeds"]

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
        self._routes: dict[tuple[tuple[int, int], ...], list[list[list[Piece]]]] = {}

    def plan(self, which: frozenset[int], whole: Mapping[int, int] = _NONE) -> _Plan:
        """Per rank, the pieces it sends of the tensors ``which`` and their length in
        bytes: its owned pieces, and all of each tensor ``t`` with ``whole[t]`` its rank."""
        key = (which, tuple(sorted((t, r) for t, r in whole.items() if t in which)))
        plan = self._plans.get(key)
        if plan is None:
            sends = []
            for r in range(self.ownership.world):
                mine = [
                    pc
                    for pc in self.ownership.pieces(r)
                    if pc.tensor in which and pc.tensor not in whole
                ]
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
    ) -> None:
        """Every rank's pieces (``plan``) of the tensors ``flat_bytes(t)`` for ``t`` in
        ``which`` (1-D bytes of the whole tensor), written into this rank's. A
        collective: every rank calls it with the same ``which`` and ``whole``;
        ``PeerLost`` if a rank fails."""
        if self.ownership.world == 1:
            return
        sends, lengths = self.plan(which, whole)
        rank = self.gather.rank
        tensors = {t: flat_bytes(t) for t in sorted(which)}
        size = self.element_sizes

        def views(r: int) -> list[torch.Tensor]:  # rank r's pieces, as bytes of the tensors
            return [tensors[t][a * size[t] : b * size[t]] for t, a, b in sends[r]]

        length = max(max(lengths), 1)  # every rank sends a slot of one size
        if self._mine is None or self._mine.numel() < length:
            self._mine = torch.zeros(length, dtype=torch.uint8, device=self.gather.device)
        mine = self._mine[:length]
        if lengths[rank]:
            torch.cat(views(rank), out=mine[: lengths[rank]])
        slots = self.gather.allgather(mine, timeout)
        for r, slot in enumerate(slots):
            if r != rank and lengths[r]:
                into = views(r)
                parts = torch.split(slot[: lengths[r]], [v.numel() for v in into])
                torch._foreach_copy_(into, list(parts))

    def routes(self, dest: Mapping[int, int]) -> list[list[list[Piece]]]:
        """``routes(dest)[r][d]``: the owned pieces rank r sends rank d, of the tensors
        ``t`` with ``dest[t] == d``, in flattened order."""
        key = tuple(sorted(dest.items()))
        routes = self._routes.get(key)
        if routes is None:
            world = self.ownership.world
            routes = [[[] for _ in range(world)] for _ in range(world)]
            for r in range(world):
                for pc in self.ownership.pieces(r):
                    if pc.tensor in dest:
                        routes[r][dest[pc.tensor]].append(pc)
            self._routes[key] = routes
        return routes

    def send_to(
        self,
        dest: Mapping[int, int],
        held: Iterable[tuple[Window, torch.Tensor | None]],
        flat_bytes: Callable[[int], torch.Tensor],
        timeout: timedelta,
    ) -> None:
        """Every rank's owned pieces of each tensor ``t`` in ``dest``, sent to rank
        ``dest[t]`` only (an all-to-all) and written there into ``flat_bytes(t)``. This
        rank's are read from ``held``: its windows with their values (1-D, the window's
        elements; None: the tensor has none this step, and zeros are sent, never read).
        A collective: every rank calls it with the same ``dest``; ``BadMessage`` for a
        buffer of another length than the ownership says, ``PeerLost`` if a rank fails."""
        routes = self.routes(dest)
        rank, world, size = self.gather.rank, self.ownership.world, self.element_sizes
        device = self.gather.device
        holding: dict[int, list[tuple[Window, torch.Tensor | None]]] = {}
        for w, values in held:
            if w.tensor in dest:
                holding.setdefault(w.tensor, []).append((w, values))

        def source(piece: Piece) -> torch.Tensor:  # an owned piece, from its window
            t, a, b = piece
            w, values = next(x for x in holding[t] if x[0].start <= a and b <= x[0].stop)
            if values is None:
                return torch.zeros((b - a) * size[t], dtype=torch.uint8, device=device)
            return values[a - w.start : b - w.start].view(torch.uint8)

        def length(pieces: list[Piece]) -> int:
            return sum((b - a) * size[t] for t, a, b in pieces)

        empty = torch.empty(0, dtype=torch.uint8, device=device)
        sends = [
            torch.cat([source(pc) for pc in routes[rank][d]]) if routes[rank][d] else empty
            for d in range(world)
        ]
        longest = max(length(routes[r][d]) for r in range(world) for d in range(world))
        got = self.gather.alltoall(sends, longest, timeout)
        mine = {t for t, d in dest.items() if d == rank}
        tensors = {t: flat_bytes(t) for t in sorted(mine)}
        for r, buf in enumerate(got):
            pieces = routes[r][rank]
            if buf.numel() != length(pieces):
                raise BadMessage(f"rank {r} sent {buf.numel()} bytes, {length(pieces)} expected")
            at = 0
            for t, a, b in pieces:
                n = (b - a) * size[t]
                tensors[t][a * size[t] : b * size[t]] = buf[at : at + n]
                at += n


def assign_whole(
    costs: Mapping[int, int], world: int, speeds: Sequence[float] | None = None
) -> dict[int, int]:
    """The rank that takes each tensor whole (by tensor index): the costliest first, each
    to the rank that would finish it first, its load with the tensor over its ``speed``
    (the lowest rank on a tie; equal speeds, or none: the least loaded). A pure function
    of the costs, the world size and the speeds: every rank computes the same from the
    plan's agreed weights (balance.py), so a slow member gets less whole-tensor work."""
    rates = check_speeds(speeds, world)
    load = [0] * world
    out: dict[int, int] = {}
    for t in sorted(costs, key=lambda t: (-costs[t], t)):
        r = min(range(world), key=lambda r: ((load[r] + costs[t]) / rates[r], r))
        out[t] = r
        load[r] += costs[t]
    return out


def check_speeds(speeds: Sequence[float] | None, world: int) -> list[float]:
    """``speeds`` (one per rank, finite and > 0; None: all 1.0) as a list, or ConfigError
    naming the bad value."""
    if speeds is None:
        return [1.0] * world
    rates = list(speeds)
    if len(rates) != world:
        raise ConfigError(f"speeds={rates!r}: one per rank of {world} expected")
    for r, v in enumerate(rates):
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
            raise ConfigError(f"speeds[{r}]={v!r} must be a finite number > 0")
    return [float(v) for v in rates]
