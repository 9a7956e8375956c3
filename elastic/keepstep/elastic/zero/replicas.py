"""ZeRO-1's replicas stepped where they are kept, so a commit sends no optimizer state.

Where it sits: beside ``ZeroOptimizer`` in the job's sharded step (sharded.py). Every
member of a ZeRO-1 epoch holds the whole reduced gradient and the same parameters, so the
member that keeps a replica of another's pieces can step them itself, as their owner
does, instead of receiving their state at every commit. It gets them once, from the
epoch's first commit (the exchange of sharded_snapshot.exchange_pieces), and from then on
steps them before the owners' step and the parameter gather (which reads the parameters
before they change), on copies of the parameters' windows: the owner's copy of every
parameter wins, and nothing here writes one.

Same bits as the owner's
    Each replica piece is stepped in a window widened to multiples of ``align`` from its
    tensor's start and clipped at its end, as the owner's windows are (zero/ownership.py):
    every element sits at the same place in the kernels' vector loops, so it gets the
    bits the owner's step gives it. The scratch lanes' state starts at zero and is never
    exported. The optimizer is the script's class with its param groups' hyper-parameters,
    synchronised before every step, as the owner's shard optimizer is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from keepstep.elastic.snapshot_shard import PieceKey
from keepstep.elastic.zero.optimizers import load_states, rebuild, sync_groups
from keepstep.elastic.zero.ownership import ALIGN

__all__ = ["ReplicaSteps"]


class ReplicaSteps:
    """The replica pieces one member keeps, stepped in place of receiving them.

    ``pieces``: their state after the epoch's first commit, keyed by the optimizer's
    parameter index and element range (sharded_snapshot's pieces); ``keys``: the
    optimizer's per-element state keys. Pieces of one tensor whose windows touch share
    one window (fewer scratch lanes, fewer kernel calls) when their per-tensor values
    (a step count) agree. Copies what it is given.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pieces: Mapping[PieceKey, Mapping[str, Any]],
        keys: frozenset[str],
        align: int = ALIGN,
    ) -> None:
        self.front, self.keys = optimizer, keys
        groups = optimizer.param_groups
        mine = [p for group in groups for p in group["params"]]
        group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
        spans: list[_Span] = []
        for key in sorted(pieces):  # an empty tensor's gets an empty window (its step count)
            param = mine[key.param]
            start = key.start // align * align
            stop = min(param.numel(), -(-key.stop // align) * align)
            last = spans[-1] if spans else None
            if (
                last is not None
                and last.pieces[0].param == key.param
                and start <= last.stop
                and _same_per_tensor(pieces[last.pieces[0]], pieces[key], keys)
            ):
                last.stop = max(last.stop, stop)
                last.pieces.append(key)
            else:
                spans.append(_Span(param, start, stop, [key]))
        per_group: list[list[torch.Tensor]] = [[] for _ in groups]
        self._windows: list[tuple[_Span, torch.Tensor]] = []
        states = []
        for span in spans:
            p = span.param
            window = torch.empty(span.stop - span.start, dtype=p.dtype, device=p.device)
            per_group[group_of[id(p)]].append(window)
            self._windows.append((span, window))
            states.append(_widened(span, pieces, keys))
        self.inner = rebuild(optimizer, per_group)
        # The pieces arrive on the CPU: loaded onto the windows' device by torch's rules.
        order = [w for g in self.inner.param_groups for w in g["params"]]
        index = {id(w): i for i, w in enumerate(order)}
        load_states(
            self.inner, {index[id(w)]: s for (_, w), s in zip(self._windows, states, strict=True)}
        )

    def step(self) -> None:
        """Step every replica window on the parameters and gradients as they are now:
        call it before the owners' step and gather change the parameters."""
        sync_groups(self.front, self.inner)
        with torch.no_grad():
            for span, window in self._windows:
                window.copy_(span.param.detach().reshape(-1)[span.start : span.stop])
                grad = span.param.grad
                window.grad = None if grad is None else grad.reshape(-1)[span.start : span.stop]
        try:
            self.inner.step()
        finally:
            for _, window in self._windows:
                window.grad = None

    def pieces(self) -> dict[PieceKey, dict[str, Any]]:
        """The replicas' state as pieces (views of it: copy before the next ``step``)."""
        out: dict[PieceKey, dict[str, Any]] = {}
        for span, window in self._windows:
            state = self.inner.state[window]
            for key in span.pieces:
                a, b = key.start - span.start, key.stop - span.start
                out[key] = {k: (v[a:b] if k in self.keys else v) for k, v in state.items()}
        return out

    def state_bytes(self) -> int:
        """Bytes of the replicas' optimizer state held here (scratch lanes included)."""
        return sum(
            v.numel() * v.element_size()
            for state in self.inner.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )


@dataclass
class _Span:
    """One replica window: elements ``[start, stop)`` of ``param``, holding ``pieces``."""

    param: torch.Tensor
    start: int
    stop: int
    pieces: list[PieceKey]


def _same_per_tensor(a: Mapping[str, Any], b: Mapping[str, Any], keys: frozenset[str]) -> bool:
    """Whether two pieces of one tensor hold the same per-tensor values (and names)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        if name in keys:
            continue
        y = b[name]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            return False
    return True


def _widened(
    span: _Span, pieces: Mapping[PieceKey, Mapping[str, Any]], keys: frozenset[str]
) -> dict[str, Any]:
    """A window's state: each piece's per-element values copied in at its place (zero in
    the scratch lanes), the first piece's per-tensor values copied (they all agree)."""
    out: dict[str, Any] = {}
    length = span.stop - span.start
    for key in span.pieces:
        at = key.start - span.start
        for name, value in pieces[key].items():
            if name in keys:
                if name not in out:
                    out[name] = torch.zeros(length, dtype=value.dtype, device=value.device)
                out[name][at : at + value.numel()] = value.reshape(-1)
            elif name not in out:
                out[name] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
