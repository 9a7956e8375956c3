"""A sharded member's snapshot state: its own shard and the replicas it keeps, as pieces.

Where it sits: below sharded_snapshot.py (the job's commits and rejoins). The optimizer
part of a member's snapshot is cut down to the elements the placement gives it
(``shard.place_replicas``: copy 0 is its own shard, copy k a replica of another node's);
entering an epoch, a member joins the windows it steps from its pieces and those it
fetched, and a checkpoint's resume joins the full state from every member's pieces.

    holds = snapshot_ranges(place_replicas(layout))      # member -> merged element ranges
    uncovered(holds, live)                                # what no live member holds
    mine = cut_state(full_state, sizes, keys, holds[me])  # the snapshot's optimizer part
    state = join_windows([mine, fetched], windows, keys)  # entering an epoch: its windows
    full = join_states([mine, theirs, ...], sizes, keys)  # the whole state, from all pieces

Ranges are offsets in the concatenation of the flattened parameters (``sizes``, in the
optimizer's parameter order), as in the layouts. Per-element state (``keys``: Adam's
moments) is sliced; per-tensor values (Adam's step) go with every piece of their tensor,
and the state of an empty parameter with every member (a few numbers), so each holder of
any element of a tensor can give back its whole state.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from keepstep.elastic.errors import StateShapeError
from keepstep.elastic.shard.layout import Range, pieces_of
from keepstep.elastic.shard.moves import Copies
from keepstep.elastic.zero.state import slice_state

__all__ = ["PieceKey", "cut_state", "join_states", "join_windows", "snapshot_ranges", "uncovered"]


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
) -> dict[int, dict[str, Any]]:
    """The full per-parameter state (``state_dict()["state"]``) from members' pieces.

    Pieces may overlap (an owner and a replica); overlapping pieces must agree on
    per-tensor values. ``StateShapeError`` names a (non-empty) parameter some of whose
    elements no piece delivered: a double fault is reported, never filled with zeros.
    (A member that needs its own windows only joins them with ``join_windows``.)
    ``shapes`` (the parameters' shapes)
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
    for t, n in enumerate(sizes):
        gaps = uncovered({"all": covered.get(t, ())}, {"all"}, n)
        if gaps:
            raise StateShapeError(f"parameter {t}: elements {list(gaps)[:4]} have no copy")
        if t not in scalars and t not in flat:
            continue  # no state yet
        state = dict(scalars.get(t, {}))
        for key, value in flat.get(t, {}).items():
            state[key] = value if shapes is None else value.view(shapes[t])
        out[t] = state
    return out


def join_windows(
    parts: Iterable[Mapping[PieceKey, Mapping[str, Any]]],
    windows: Sequence[PieceKey],
    keys: frozenset[str],
) -> list[dict[str, Any]]:
    """The state of each of ``windows`` (a parameter's elements ``[start, stop)``) from
    members' pieces, building no parameter's full state: a per-element value is the
    covering pieces' elements joined (flat, a copy), a per-tensor one the pieces' (which
    must agree); ``{}`` for a parameter without state yet. Pieces may overlap (a seed
    joined from a checkpoint's parts). ``StateShapeError`` names a window some of whose
    elements no piece delivered (a double fault is reported, never filled in), or whose
    pieces hold different state."""
    held: dict[int, list[tuple[int, int, Mapping[str, Any]]]] = {}
    for part in parts:
        for (t, a, b), piece in part.items():
            held.setdefault(t, []).append((a, b, piece))
    reach: dict[int, list[int]] = {}  # per parameter: the furthest stop so far, in order
    for t, pieces in held.items():
        pieces.sort(key=lambda p: (p[0], -p[1]))
        reach[t] = list(accumulate((p[1] for p in pieces), max))
    return [_window(t, a, b, held.get(t, []), reach.get(t, []), keys) for t, a, b in windows]


def _window(
    t: int,
    start: int,
    stop: int,
    pieces: Sequence[tuple[int, int, Mapping[str, Any]]],
    reach: Sequence[int],
    keys: frozenset[str],
) -> dict[str, Any]:
    where = f"parameter {t}, elements {start}..{stop}"
    if start == stop:  # an empty tensor's window: its per-tensor state, if any piece has it
        return next((dict(p) for a, b, p in pieces if a == b == 0), {})
    at, gap, names = start, stop, None  # gap: where the next piece starts, if past `at`
    joined: dict[str, list[torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    for a, b, piece in pieces[bisect_right(reach, start) :]:
        if a > at:
            gap = min(a, stop)
            break
        if b <= at:
            continue
        hi = min(b, stop)
        if names is None:
            names = set(piece)
        elif set(piece) != names:
            raise StateShapeError(f"{where}: its pieces hold different state")
        for key, value in piece.items():
            if key not in keys:
                if key in scalars and not _same(scalars[key], value):
                    raise StateShapeError(f"{where}: pieces disagree on {key!r}")
                scalars.setdefault(key, value)
            elif not isinstance(value, torch.Tensor) or value.numel() != b - a:
                raise StateShapeError(f"parameter {t}: {key!r} of {a}..{b} has a bad size")
            else:
                joined.setdefault(key, []).append(value.reshape(-1)[at - a : hi - a])
        at = hi
        if at >= stop:
            break
    if at < stop:
        raise StateShapeError(f"{where}: elements {at}..{gap} have no copy")
    return {**scalars, **{k: torch.cat(v) for k, v in joined.items()}}


def _own(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(type(a) is type(b) and a == b)
