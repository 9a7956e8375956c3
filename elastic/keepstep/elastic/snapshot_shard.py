"""What a sharded member's snapshot would hold: its own shard and the replicas it keeps.

Where it sits: the next step after sharded.py, whose snapshots still hold the full
optimizer state. Here the optimizer part of a member's snapshot is cut down to the
elements the placement gives it (``shard.place_replicas``: copy 0 is its own shard, copy
k a replica of another node's), and after a loss the full state is joined again from the
survivors' pieces. Not wired into the job yet: the job keeps full snapshots.

    holds = snapshot_ranges(place_replicas(layout))      # member -> merged element ranges
    uncovered(holds, live)                                # what no live member holds
    mine = cut_state(full_state, sizes, keys, holds[me])  # the snapshot's optimizer part
    full = join_states([mine, theirs, ...], sizes, keys)  # after a loss: survivors' pieces

Ranges are offsets in the concatenation of the flattened parameters (``sizes``, in the
optimizer's parameter order), as in the layouts. Per-element state (``keys``: Adam's
moments) is sliced; per-tensor values (Adam's step) go with every piece of their tensor,
and the state of an empty parameter with every member (a few numbers), so each holder of
any element of a tensor can give back its whole state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from keepstep.elastic.errors import StateShapeError
from keepstep.elastic.shard.layout import Range, pieces_of
from keepstep.elastic.shard.moves import Copies
from keepstep.elastic.zero.state import slice_state

__all__ = ["PieceKey", "cut_state", "join_states", "snapshot_ranges", "uncovered"]


class PieceKey(NamedTuple):
    """Elements ``[start, stop)`` of the optimizer's parameter ``param``."""

    param: int
    start: int
    stop: int


def snapshot_ranges(copies: Copies) -> dict[str, tuple[Range, ...]]:
    """Every member's element ranges in its snapshot (own shard and replicas), merged."""
    found: dict[str, list[Range]] = {}
    for member, start, stop, _copy in copies.holdings():
        found.setdefault(member, []).append(Range(start, stop))
    return {m: merge(rs) for m, rs in sorted(found.items())}


def merge(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sorted ranges with overlapping and touching ones joined."""
    out: list[Range] = []
    for r in sorted(r for r in ranges if r.stop > r.start):
        if out and r.start <= out[-1].stop:
            out[-1] = Range(out[-1].start, max(out[-1].stop, r.stop))
        else:
            out.append(r)
    return tuple(out)


def uncovered(
    holds: Mapping[str, Sequence[Range]], live: Collection[str], total: int
) -> tuple[Range, ...]:
    """The ranges of ``[0, total)`` that no member in ``live`` holds: empty means every
    element still has a live copy."""
    covered = merge(r for m, rs in holds.items() if m in live for r in rs)
    gaps: list[Range] = []
    at = 0
    for r in covered:
        if r.start > at:
            gaps.append(Range(at, min(r.start, total)))
        at = max(at, r.stop)
    if at < total:
        gaps.append(Range(at, total))
    return tuple(g for g in gaps if g.stop > g.start)


def cut_state(
    state: Mapping[str, Any],
    sizes: Sequence[int],
    keys: frozenset[str],
    ranges: Sequence[Range],
) -> dict[PieceKey, dict[str, Any]]:
    """The pieces of ``state`` (an optimizer ``state_dict()``, full) that ``ranges`` hold:
    per-element values cloned (a snapshot outlives the step), per-tensor values as they
    are. A piece of a parameter without state (no step yet) is an empty dict, so that
    ``join_states`` can tell it from a lost one; empty parameters' state always comes."""
    offsets = (0, *accumulate(sizes))
    per_param = state["state"]
    out: dict[PieceKey, dict[str, Any]] = {}
    for r in ranges:
        for t, a, b in pieces_of(offsets, r.start, r.stop):
            cut = slice_state(per_param[t], keys, a, b) if t in per_param else {}
            out[PieceKey(t, a, b)] = {k: _own(v) if k in keys else v for k, v in cut.items()}
    for t, n in enumerate(sizes):
        if n == 0 and t in per_param:
            out[PieceKey(t, 0, 0)] = dict(per_param[t])
    return out


def join_states(
    parts: Iterable[Mapping[PieceKey, Mapping[str, Any]]],
    sizes: Sequence[int],
    keys: frozenset[str],
    shapes: Sequence[torch.Size] | None = None,
    required: Sequence[Range] | None = None,
) -> dict[int, dict[str, Any]]:
    """The full per-parameter state (``state_dict()["state"]``) from members' pieces.

    Pieces may overlap (an owner and a replica); overlapping pieces must agree on
    per-tensor values. ``StateShapeError`` names a (non-empty) parameter some of whose
    elements no piece delivered: a double fault is reported, never filled with zeros.
    With ``required`` (ranges of the flattened state) only those elements must be
    delivered: a member joining what its own shard needs gets tensors of full shape whose
    other elements are zeros it never reads. ``shapes`` (the parameters' shapes)
    reshapes the per-element values; without it they stay flat.
    """
    flat: dict[int, dict[str, torch.Tensor]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    covered: dict[int, list[Range]] = {}
    for part in parts:
        for (t, a, b), piece in part.items():
            if not 0 <= t < len(sizes) or not 0 <= a <= b <= sizes[t]:
                raise StateShapeError(f"piece {(t, a, b)} is outside the parameters {sizes[:8]}")
            covered.setdefault(t, []).append(Range(a, b))
            for key, value in piece.items():
                if key not in keys:
                    known = scalars.setdefault(t, {})
                    if key in known and not _same(known[key], value):
                        raise StateShapeError(f"parameter {t}: pieces disagree on {key!r}")
                    known.setdefault(key, value)
                    continue
                if not isinstance(value, torch.Tensor) or value.numel() != b - a:
                    raise StateShapeError(f"parameter {t}: {key!r} of {a}..{b} has a bad size")
                target = flat.setdefault(t, {}).get(key)
                if target is None:
                    target = flat[t][key] = torch.zeros(
                        sizes[t], dtype=value.dtype, device=value.device
                    )
                target[a:b] = value.reshape(-1)
    out: dict[int, dict[str, Any]] = {}
    offsets = (0, *accumulate(sizes))
    wanted: dict[int, list[Range]] | None = None
    if required is not None:
        wanted = {}
        for r in required:
            for t, a, b in pieces_of(offsets, r.start, r.stop):
                wanted.setdefault(t, []).append(Range(a, b))
    for t, n in enumerate(sizes):
        gaps = uncovered({"all": covered.get(t, ())}, {"all"}, n)
        if wanted is not None:
            gaps = tuple(g for g in gaps for w in wanted.get(t, ()) if _overlap(g, w))
        if gaps:
            raise StateShapeError(f"parameter {t}: elements {list(gaps)[:4]} have no copy")
        if t not in scalars and t not in flat:
            continue  # no state yet
        state = dict(scalars.get(t, {}))
        for key, value in flat.get(t, {}).items():
            state[key] = value if shapes is None else value.view(shapes[t])
        out[t] = state
    return out


def _overlap(a: Range, b: Range) -> bool:
    return a.start < b.stop and b.start < a.stop


def _own(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(type(a) is type(b) and a == b)
