"""Muon's matrices under ZeRO: each stepped whole by one rank (zero/muon.py says why).

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) builds one ``WholeMatrices`` per
epoch over the tensors Muon steps; ``MuonWindows`` hands it the windows' momentum updates
at the end of every step (its finisher). The owners send their pieces of each matrix's
update to the rank ``designate`` gave the matrix, and to it only (an all-to-all:
PieceGather.send_to), which steps the matrix whole (``step_matrix``); the parameter
gather that follows sends every matrix whole from that rank (``designated``, PieceGather's
``whole``). Memory and traffic: a rank receives and holds whole updates for its own
matrices only (about 1/W of them); the pieces it sends are read from its windows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from keepstep.elastic.zero.muon import designate, step_matrix
from keepstep.elastic.zero.ownership import Window
from keepstep.elastic.zero.pieces import PieceGather

__all__ = ["WholeMatrices"]


class WholeMatrices:
    """The whole-matrix steps of ``matrices`` (tensor indices into ``params``), for the rank
    whose ``windows`` and their 1-D ``views`` are given, over ``pieces``' ranks."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        matrices: frozenset[int],
        windows: Sequence[Window],
        views: Sequence[torch.Tensor],
        pieces: PieceGather,
    ) -> None:
        self.params = params
        self.matrices = matrices
        self.pieces = pieces
        self._windows = list(zip(windows, views, strict=True))
        self.designated: dict[int, int] = {}
        self.mine: frozenset[int] = frozenset()
        self.designate(None)

    def designate(self, speeds: Sequence[float] | None) -> None:
        """Give each matrix to a rank by the ranks' ``speeds`` (None: equal): between
        steps, with the same speeds on every rank (the plan's weights)."""
        shapes = {t: tuple(self.params[t].shape) for t in self.matrices}
        self.designated = designate(shapes, self.pieces.ownership.world, speeds)
        rank = self.pieces.gather.rank
        self.mine = frozenset(t for t, r in self.designated.items() if r == rank)

    def step(
        self,
        updates: Mapping[torch.Tensor, torch.Tensor],
        given: frozenset[int],
        groups: Mapping[int, Mapping[str, Any]],
        timeout: timedelta,
    ) -> None:
        """Gather the windows' ``updates`` (by view) into the designated ranks, and step
        this rank's matrices that have a gradient (``given``) with their param group's
        hyper-parameters (``groups``, by tensor). A collective: every rank calls it."""
        # Every element arrives: the ownership has one owner for each.
        full = {t: torch.empty_like(self.params[t].detach().view(-1)) for t in self.mine}
        held = [(w, updates.get(view)) for w, view in self._windows]
        self.pieces.send_to(self.designated, held, lambda t: full[t].view(torch.uint8), timeout)
        for t in sorted(self.mine & given):  # torch's Muon leaves one without a gradient
            p = self.params[t]
            step_matrix(p.detach(), full[t].view(p.shape), groups[t])
