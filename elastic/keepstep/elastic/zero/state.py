"""Optimizer state of a shard: cut from the full state, joined from pieces, and gathered.

Where it sits: the state half of ``ZeroOptimizer`` (zero/optimizer.py), which holds its
state per *window* (see zero/ownership.py). Three shapes of the same state meet here:

    full     torch's optimizer format over the whole parameters (a durable checkpoint,
             the optimizer-state hash): per-element values shaped like each parameter
    pieces   what a snapshot holds: the owned pieces only, 1-D (``ZeroOptimizer.state_dict``)
    windows  what the shard optimizer steps: the pieces plus scratch lanes around them

Per-element values (``keys``, from zero/optimizers.py) are sliced; per-tensor values (a
step count) belong to every piece of the tensor alike. The gather sends, from every rank,
a JSON header (never pickle) and the raw bytes of its owned pieces; each rank checks the
header against the ownership every rank computes alike, and puts the full state together.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from keepstep.elastic.errors import BadMessage, StateShapeError
from keepstep.elastic.shard.layout import Piece, Range
from keepstep.elastic.zero.ownership import Ownership, Window

__all__ = ["join_pieces", "pack_owned", "slice_state", "unpack_full"]

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_HEADER_LEN = 8  # bytes of the little-endian header length that starts every payload


def slice_state(state: Mapping[str, Any], keys: frozenset[str], a: int, b: int) -> dict[str, Any]:
    """Elements ``[a, b)`` of every per-element value (flattened views, no copies); the
    per-tensor values as they are."""
    return {k: v.reshape(-1)[a:b] if k in keys else v for k, v in state.items()}


def join_pieces(
    window: Window, pieces: Sequence[Mapping[str, Any]], keys: frozenset[str]
) -> dict[str, Any] | None:
    """The window's state from the states of its owned pieces (in ``window.owned`` order);
    scratch lanes are zero. None if no piece has state."""
    where = f"tensor {window.tensor}, elements {window.start}..{window.stop}"
    if not any(pieces):
        return None
    names = [list(p) for p in pieces]
    if any(n != names[0] for n in names):
        raise StateShapeError(f"{where}: the pieces of one window hold different state {names}")
    owned = window.owned or (Range(0, 0),)
    if len(owned) != len(pieces):
        raise StateShapeError(f"{where}: {len(pieces)} piece states for {len(owned)} pieces")
    out: dict[str, Any] = {}
    for key, first in pieces[0].items():
        if key not in keys:
            for p in pieces[1:]:
                if not _same(p[key], first):
                    raise StateShapeError(f"{where}: pieces disagree on {key!r}")
            out[key] = first
            continue
        buf = torch.zeros(window.stop - window.start, dtype=first.dtype, device=first.device)
        for r, p in zip(owned, pieces, strict=True):
            part = p[key]
            if not isinstance(part, torch.Tensor) or part.numel() != r.size:
                raise StateShapeError(f"{where}: state {key!r} of piece {r} must have {r.size}")
            buf[r.start - window.start : r.stop - window.start] = part.reshape(-1)
        out[key] = buf
    return out


def pack_owned(
    windows: Sequence[Window],
    states: Sequence[Mapping[str, Any]],
    params: Sequence[torch.Tensor],
    keys: frozenset[str],
    device: torch.device,
) -> torch.Tensor:
    """This rank's contribution to the full state, as one uint8 tensor on ``device``.

    Header: ``pieces`` ([tensor, start, stop, [[key, dtype], ...]]: raw bytes follow in
    that order) and ``tensors`` (for each tensor whose first element this rank owns, or
    whose empty window it anchors: its keys in order and its per-tensor values).
    """
    pieces: list[list[Any]] = []
    tensors: list[list[Any]] = []
    chunks: list[torch.Tensor] = []
    for w, state in zip(windows, states, strict=True):
        if not state:
            continue
        elems = [k for k in state if k in keys]
        # An empty tensor's window owns nothing; it still lists the keys and dtypes.
        for r in w.owned or (Range(0, 0),):
            pieces.append([w.tensor, r.start, r.stop, [[k, _name(state[k])] for k in elems]])
            for k in elems:
                part = state[k][r.start - w.start : r.stop - w.start]
                chunks.append(part.contiguous().view(torch.uint8).to(device))
        if w.stop == 0 or any(r.start == 0 for r in w.owned):
            scalars = {k: _encode(v, params[w.tensor]) for k, v in state.items() if k not in keys}
            tensors.append([w.tensor, list(state), scalars])
    header = json.dumps({"pieces": pieces, "tensors": tensors}).encode()
    head = torch.frombuffer(
        bytearray(len(header).to_bytes(_HEADER_LEN, "little")), dtype=torch.uint8
    )
    body = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return torch.cat([head.to(device), body.to(device), *chunks])


def unpack_full(
    slots: Sequence[torch.Tensor],
    ownership: Ownership,
    params: Sequence[torch.Tensor],
    keys: frozenset[str],
) -> dict[int, dict[str, Any]]:
    """The full state by tensor index, from every rank's ``pack_owned`` payload.

    Each payload is checked against what its rank owns (``BadMessage`` otherwise): pieces
    it owns, keys of this optimizer, known dtypes, lengths that add up, and every element
    of every per-element value delivered exactly once.
    """
    full: dict[int, dict[str, torch.Tensor]] = {}
    covered: dict[tuple[int, str], int] = {}
    layout: dict[int, tuple[list[str], dict[str, Any]]] = {}
    for rank, slot in enumerate(slots):
        header, body = _split(rank, slot)
        mine = set(ownership.pieces(rank))
        offset = 0
        for entry in _list(header, "pieces", rank):
            t, a, b, listed = _entry(entry, rank, 4, 3, len(params))
            empty = a == b == 0 and params[t].numel() == 0 and ownership.anchor(t) == rank
            if Piece(t, a, b) not in mine and not empty:
                raise BadMessage(f"rank {rank} sent tensor {t} elements {a}..{b}, not its own")
            for key, dtype_name in _pairs(listed, rank):
                dtype = _dtype(dtype_name, rank)
                if key not in keys:
                    raise BadMessage(
                        f"rank {rank} sent per-element state {key!r}, not one of {sorted(keys)}"
                    )
                target = full.setdefault(t, {}).get(key)
                if target is None:
                    target = torch.zeros(params[t].numel(), dtype=dtype, device=params[t].device)
                    full[t][key] = target
                elif target.dtype != dtype:
                    raise BadMessage(f"rank {rank} sent {key!r} of tensor {t} as {dtype_name}")
                n = (b - a) * target.element_size()
                if offset + n > body.numel():
                    raise BadMessage(f"rank {rank}: payload ends before tensor {t} {key!r}")
                target[a:b].view(torch.uint8).copy_(body[offset : offset + n])
                offset += n
                covered[t, key] = covered.get((t, key), 0) + (b - a)
        if offset != body.numel():
            raise BadMessage(f"rank {rank}: {body.numel() - offset} bytes left over")
        for entry in _list(header, "tensors", rank):
            t, order, scalars = _entry(entry, rank, 3, 1, len(params))
            if ownership.anchor(t) != rank or t in layout:
                raise BadMessage(f"rank {rank} sent the per-tensor state of tensor {t}")
            if not isinstance(order, list) or not isinstance(scalars, dict):
                raise BadMessage(f"rank {rank}: bad per-tensor state of tensor {t}")
            layout[t] = (order, scalars)
    out: dict[int, dict[str, Any]] = {}
    for t in sorted(set(layout) | set(full)):
        if t not in layout:
            raise BadMessage(f"tensor {t} has per-element state but its anchor sent none")
        order, scalars = layout[t]
        state: dict[str, Any] = {}
        for key in order:
            if key in keys:
                if covered.get((t, key), -1) != params[t].numel():
                    raise BadMessage(f"tensor {t}: state {key!r} was not delivered whole")
                state[key] = full[t][key].view(params[t].shape)
            elif key in scalars:
                state[key] = _decode(scalars[key], params[t], t)
            else:
                raise BadMessage(f"tensor {t}: state {key!r} is listed but not sent")
        out[t] = state
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return bool(type(a) is type(b) and a == b)


def _name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _encode(value: Any, param: torch.Tensor) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise StateShapeError(f"per-tensor state {value!r} must be one real number")
        where = "param" if value.device == param.device else "cpu"
        return ["tensor", _name(value), value.item(), list(value.shape), where]
    if isinstance(value, bool | int | float):
        return [type(value).__name__, value]
    raise StateShapeError(f"per-tensor state of type {type(value).__name__} cannot be gathered")


def _decode(spec: Any, param: torch.Tensor, t: int) -> Any:
    kinds = {"bool": bool, "int": int, "float": float}
    if isinstance(spec, list) and len(spec) == 2 and spec[0] in kinds:
        return kinds[spec[0]](spec[1])
    if isinstance(spec, list) and len(spec) == 5 and spec[0] == "tensor":
        _, dtype, value, shape, where = spec
        device = param.device if where == "param" else torch.device("cpu")
        if not isinstance(shape, list) or len(shape) > 1:
            raise BadMessage(f"tensor {t}: bad per-tensor state shape {shape!r}")
        return torch.tensor(value, dtype=_dtype(dtype, t), device=device).reshape(shape)
    raise BadMessage(f"tensor {t}: bad per-tensor state {spec!r}"[:200])


def _split(rank: int, slot: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    raw = slot.cpu()
    if raw.numel() < _HEADER_LEN:
        raise BadMessage(f"rank {rank}: payload of {raw.numel()} bytes has no header")
    n = int.from_bytes(bytes(raw[:_HEADER_LEN].tolist()), "little")
    if n > raw.numel() - _HEADER_LEN:
        raise BadMessage(f"rank {rank}: header of {n} bytes is longer than the payload")
    try:
        header = json.loads(bytes(raw[_HEADER_LEN : _HEADER_LEN + n].tolist()))
    except (UnicodeDecodeError, ValueError) as err:
        raise BadMessage(f"rank {rank}: header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise BadMessage(f"rank {rank}: header must be an object")
    return header, slot[_HEADER_LEN + n :]


def _list(header: dict[str, Any], name: str, rank: int) -> list[Any]:
    value = header.get(name)
    if not isinstance(value, list):
        raise BadMessage(f"rank {rank}: header field {name!r} must be a list")
    return value


def _entry(entry: Any, rank: int, n: int, ints: int, tensors: int) -> list[Any]:
    """A header entry of ``n`` fields whose first ``ints`` are ints >= 0, the first a tensor."""
    if (
        not isinstance(entry, list)
        or len(entry) != n
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in entry[:ints])
        or entry[0] >= tensors
    ):
        raise BadMessage(f"rank {rank}: bad header entry {entry!r}"[:200])
    return entry


def _pairs(listed: Any, rank: int) -> list[tuple[str, str]]:
    if not isinstance(listed, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in listed
    ):
        raise BadMessage(f"rank {rank}: bad key list {listed!r}"[:200])
    return [(p[0], p[1]) for p in listed]


def _dtype(name: Any, where: int) -> torch.dtype:
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise BadMessage(f"{where}: unknown dtype {name!r}")
    return dtype
