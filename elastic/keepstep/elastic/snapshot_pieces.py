"""Pieces of optimizer state as bytes: what members exchange to rebuild it after a loss.

Where it sits: beside snapshot_shard.py. When a sharded job's snapshots hold only a
member's own shard and its replicas, the members of a new epoch send each other the
pieces they hold (``Communicator.allgather_bytes``) and join them (``join_states``). The
bytes come from a peer, so they are data only: a JSON header (never pickle) and the raw
bytes of every tensor in header order, each checked against the parameters every member
knows (index, element range, known dtype, sizes that add up) before a byte is used.

    raw = pack_pieces(cut_state(full, sizes, keys, ranges))
    pieces = unpack_pieces(raw, sizes, keys)            # BadMessage if anything is off
    raw = concat_pieces([raw_a, raw_b])                 # both members' pieces, each once
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from keepstep.elastic.comm.rounds import Alloc
from keepstep.elastic.errors import BadMessage, StateShapeError
from keepstep.elastic.snapshot_shard import PieceKey

__all__ = [
    "Indexed",
    "concat_pieces",
    "index_pieces",
    "indexed_values",
    "join_segments",
    "pack_payloads",
    "pack_pieces",
    "pack_segments",
    "pack_tensor",
    "unpack_pieces",
]

_HEAD = 8  # bytes of the little-endian header length that starts the payload
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool".split()
}
_PLAIN = {"bool": bool, "int": int, "float": float}


def pack_pieces(pieces: Mapping[PieceKey, Mapping[str, Any]]) -> bytes:
    """``pieces`` (``cut_state``'s) as one payload: header, then tensor bytes in order."""
    return pack_tensor(pieces).numpy().tobytes()


def pack_tensor(
    pieces: Mapping[PieceKey, Mapping[str, Any]],
    tail: Sequence[Indexed] = (),
    alloc: Alloc | None = None,
) -> torch.Tensor:
    """``pack_pieces``'s payload as a uint8 tensor (what a snapshot stores), each value's
    bytes copied once into it; then the pieces of the checked payloads ``tail``, their
    bodies copied whole. ``alloc`` gives the buffer (one kept from the last commit of the
    same layout is written warm, where a fresh one is faulted in page by page)."""
    header, tensors = _layout(pieces, tail)
    size = _HEAD + len(header) + sum(_nbytes_of(v) for v in tensors)
    out = torch.empty(size, dtype=torch.uint8) if alloc is None else alloc(size)
    _write(out, header, tensors)
    return out


def pack_segments(
    pieces: Mapping[PieceKey, Mapping[str, Any]], tail: Sequence[Indexed] = ()
) -> list[torch.Tensor]:
    """``pack_tensor``'s payload as 1-D segments whose bytes, in order, are that payload
    (``join_segments``), nothing copied but the header: the others are the values (of
    their own dtypes: no per-value cast) and ``tail``'s bodies, which must not change while
    the segments are read (a snapshot copies them later, off the step's path). Empty
    values give no segment."""
    header, tensors = _layout(pieces, tail)
    head = torch.empty(_HEAD + len(header), dtype=torch.uint8)
    _write(head, header, ())
    out = [head]
    for value in tensors:
        if value.numel():
            out.append(value if value.is_contiguous() else value.contiguous())
    return out


def join_segments(segments: Sequence[torch.Tensor]) -> torch.Tensor:
    """The payload whose ``pack_segments`` these are, as one uint8 tensor."""
    return torch.cat([s.reshape(-1).view(torch.uint8) for s in segments])


def pack_payloads(
    pieces: Sequence[Mapping[PieceKey, Mapping[str, Any]]], alloc: Alloc
) -> list[torch.Tensor]:
    """One payload per destination (an empty mapping: nothing to send, an empty payload),
    laid out in one buffer from ``alloc``, each followed by a spare byte: what
    ``Communicator.alltoall_tensors`` sends without copying them together first."""
    laid = [_layout(p, ()) if p else None for p in pieces]
    sizes = [0 if x is None else _HEAD + len(x[0]) + sum(map(_nbytes_of, x[1])) for x in laid]
    out = alloc(sum(sizes) + len(sizes))
    views, at = [], 0
    for x, size in zip(laid, sizes, strict=True):
        view = out[at : at + size]
        if x is not None:
            _write(view, *x)
        out[at + size] = 0  # the spare byte is sent too: nothing of the heap in it
        views.append(view)
        at += size + 1
    return views


def _layout(
    pieces: Mapping[PieceKey, Mapping[str, Any]], tail: Sequence[Indexed]
) -> tuple[bytes, list[torch.Tensor]]:
    """The header of ``pieces`` then ``tail``'s entries, and the tensors of the body in order."""
    entries: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for (t, a, b), piece in pieces.items():
        values: list[list[Any]] = []
        for key, value in piece.items():
            if isinstance(value, torch.Tensor):
                dtype = str(value.dtype).removeprefix("torch.")
                if dtype not in _DTYPES:
                    raise StateShapeError(f"parameter {t}: {key!r} has dtype {dtype}, not sent")
                values.append([key, "tensor", dtype, list(value.shape)])
                flat = value if value.dim() == 1 else value.reshape(-1)
                tensors.append(flat)  # on the device: a segment stays there (pack_segments)
            elif type(value) in (bool, int, float):
                values.append([key, type(value).__name__, value])
            else:
                raise StateShapeError(
                    f"parameter {t}: {key!r} is a {type(value).__name__}, which is not sent"
                )
        entries.append([t, a, b, values])
    for indexed in tail:
        entries.extend(indexed.entries)
        tensors.append(indexed.body)
    return json.dumps(entries).encode(), tensors


def _nbytes_of(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def _write(out: torch.Tensor, header: bytes, tensors: Sequence[torch.Tensor]) -> None:
    out[:_HEAD] = torch.frombuffer(
        bytearray(len(header).to_bytes(_HEAD, "little")), dtype=torch.uint8
    )
    if header:
        out[_HEAD : _HEAD + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    at = _HEAD + len(header)
    with torch.no_grad():
        for value in tensors:
            size = _nbytes_of(value)
            if size:
                out[at : at + size].copy_(value.contiguous().view(torch.uint8))
            at += size
    assert at == out.numel(), (at, out.numel())


class Indexed(NamedTuple):
    """A checked payload, nothing copied: its header's entries (valid JSON to send on) and
    the body they describe, with each piece's element range."""

    entries: list[list[Any]]
    body: torch.Tensor
    keys: list[PieceKey]


def index_pieces(raw: bytes | torch.Tensor, sizes: Sequence[int], keys: frozenset[str]) -> Indexed:
    """A ``pack_pieces`` payload (bytes, or ``pack_tensor``'s uint8 tensor) checked as
    ``unpack_pieces`` checks it, without reading a value: what to copy on whole."""
    flat = _flat(raw)
    entries, body = _header(flat)
    size = sum(v.nbytes for _, values in _checked(entries, sizes, keys) for v in values)
    if size > body.numel():
        raise BadMessage(f"the payload ends {size - body.numel()} bytes before its pieces do")
    if size < body.numel():
        raise BadMessage(f"{body.numel() - size} bytes left over after the pieces")
    return Indexed(entries, body, [PieceKey(*e[:3]) for e in entries])


def unpack_pieces(
    raw: bytes | torch.Tensor, sizes: Sequence[int], keys: frozenset[str]
) -> dict[PieceKey, dict[str, Any]]:
    """The pieces of a ``pack_pieces`` payload (bytes, or ``pack_tensor``'s uint8 tensor),
    checked: ``BadMessage`` names what is off (a parameter or range that does not exist, a
    per-element value of the wrong size, an unknown dtype, bytes missing or left over).
    No value shares the caller's bytes: the per-element values are views of one copy of
    the payload (their consumers copy out what they keep), the per-tensor ones (a step
    count) copies of their own, so that no kept state holds on to the whole payload."""
    entries, body = _header(_flat(raw))
    checked = list(_checked(entries, sizes, keys))  # all of it, before a byte is copied
    return _read(checked, body.clone(), keys)  # one copy, starting aligned for any dtype


def indexed_values(
    indexed: Indexed, sizes: Sequence[int], keys: frozenset[str]
) -> dict[PieceKey, dict[str, Any]]:
    """The pieces of an ``index_pieces`` payload as views of its body, nothing copied but
    per-tensor values and a value not aligned for its dtype: for a consumer that copies
    what it keeps before the body's buffer is written again."""
    return _read(list(_checked(indexed.entries, sizes, keys)), indexed.body, keys)


def _read(
    checked: Sequence[tuple[PieceKey, list[_Value]]], body: torch.Tensor, keys: frozenset[str]
) -> dict[PieceKey, dict[str, Any]]:
    """The values ``checked`` describes, read from ``body`` in order: views of it, except
    per-tensor values and values whose bytes are not aligned for their dtype (copies)."""
    offset, base = 0, body.storage_offset()
    out: dict[PieceKey, dict[str, Any]] = {}
    for key, values in checked:
        piece: dict[str, Any] = {}
        for v in values:
            if v.dtype is None or v.shape is None:
                piece[v.name] = v.plain
                continue
            if offset + v.nbytes > body.numel():
                raise BadMessage(f"parameter {key.param}: the payload ends before {v.name!r}")
            data = body[offset : offset + v.nbytes]
            if v.name not in keys or (base + offset) % v.dtype.itemsize:
                data = data.clone()  # its own (and aligned for its dtype)
            offset += v.nbytes
            piece[v.name] = data.view(v.dtype).reshape(v.shape)
        out[key] = piece
    if offset != body.numel():
        raise BadMessage(f"{body.numel() - offset} bytes left over after the pieces")
    return out


def _flat(raw: bytes | torch.Tensor) -> torch.Tensor:
    flat = (
        raw
        if isinstance(raw, torch.Tensor)
        else torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise BadMessage(f"a payload must be 1-D bytes, not {flat.dtype} {tuple(flat.shape)}")
    return flat


def _header(flat: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
    """The payload's header entries (not yet checked) and its body."""
    if flat.numel() < _HEAD:
        raise BadMessage(f"a payload of {flat.numel()} bytes has no header")
    # On a GPU only the header comes to the host; the body stays where it arrived.
    n = int.from_bytes(flat[:_HEAD].cpu().numpy().tobytes(), "little")
    if n > flat.numel() - _HEAD:
        raise BadMessage(f"header of {n} bytes is longer than the payload")
    try:
        entries = json.loads(flat[_HEAD : _HEAD + n].cpu().numpy().tobytes())
    except (UnicodeDecodeError, ValueError) as err:
        raise BadMessage(f"header is not JSON: {err}") from None
    if not isinstance(entries, list):
        raise BadMessage("header must be a list of pieces")
    return entries, flat[_HEAD + n :]


class _Value(NamedTuple):
    """One checked header value: a plain one, or a tensor's dtype, shape and bytes."""

    name: str
    plain: Any = None
    dtype: torch.dtype | None = None
    shape: list[int] | None = None
    nbytes: int = 0


def _checked(
    entries: list[Any], sizes: Sequence[int], keys: frozenset[str]
) -> Iterator[tuple[PieceKey, list[_Value]]]:
    """Each entry checked against the parameters: its key and its values in header order
    (a tensor's bytes follow the previous tensor's in the body)."""
    for entry in entries:
        t, a, b, values = _entry(entry, sizes)
        out: list[_Value] = []
        for value in values:
            key, kind, *rest = _value(value, t)
            if kind in _PLAIN and len(rest) == 1 and type(rest[0]) is _PLAIN[kind]:
                out.append(_Value(key, plain=rest[0]))
                continue
            if kind != "tensor" or len(rest) != 2:
                raise BadMessage(f"parameter {t}: bad value {value!r}"[:200])
            dtype, shape = _DTYPES.get(rest[0]), rest[1]
            if dtype is None or not _shape(shape):
                raise BadMessage(f"parameter {t}: {key!r} has dtype {rest[0]!r}, shape {shape!r}")
            count = math.prod(shape)
            if key in keys and count != b - a:
                raise BadMessage(f"parameter {t}: {key!r} has {count} values for {a}..{b}")
            out.append(_Value(key, dtype=dtype, shape=shape, nbytes=count * dtype.itemsize))
        yield PieceKey(t, a, b), out


def concat_pieces(raws: Sequence[bytes]) -> bytes:
    """One payload holding the pieces of ``raws`` (``pack_pieces`` payloads) but those
    whose elements the pieces taken before hold all of: what a sharded checkpoint's
    members kept, for one snapshot. Longer pieces are taken first, so a replica that
    spans several owners' chunks leaves their pieces out, or the other way round (about
    every element once). The tensors' bytes are not read, only counted; ``BadMessage``
    when a payload's header does not account for its bytes (``unpack_pieces`` checks the
    rest where the parameters are known)."""
    found: list[tuple[list[Any], memoryview]] = []
    for i, raw in enumerate(raws):
        found.extend(_pieces_of(memoryview(raw), i))
    found.sort(key=lambda piece: piece[0][1] - piece[0][2])  # stable: longest first
    entries: list[Any] = []
    chunks: list[memoryview] = []
    seen: set[tuple[int, int, int]] = set()
    held: dict[int, list[tuple[int, int]]] = {}  # per parameter: the ranges taken, sorted
    for entry, chunk in found:
        t, a, b = entry[:3]
        if not _held(held.setdefault(t, []), a, b, (t, a, b) in seen):
            seen.add((t, a, b))
            bisect.insort(held[t], (a, b))
            entries.append(entry)
            chunks.append(chunk)
    header = json.dumps(entries).encode()
    return len(header).to_bytes(_HEAD, "little") + header + b"".join(chunks)


def _pieces_of(view: memoryview, i: int) -> list[tuple[list[Any], memoryview]]:
    """Each piece's header entry and bytes in payload ``i``, its sizes accounted for."""
    n = int.from_bytes(view[:_HEAD], "little") if len(view) >= _HEAD else -1
    if not 0 <= n <= len(view) - _HEAD:
        raise BadMessage(f"payload {i} of {len(view)} bytes has no whole header")
    try:
        header = json.loads(bytes(view[_HEAD : _HEAD + n]))
    except (UnicodeDecodeError, ValueError) as err:
        raise BadMessage(f"payload {i}: header is not JSON: {err}") from None
    if not isinstance(header, list):
        raise BadMessage(f"payload {i}: header must be a list of pieces")
    at = _HEAD + n
    out = []
    for entry in header:
        if (
            not isinstance(entry, list)
            or len(entry) != 4
            or not all(type(x) is int for x in entry[:3])
            or not isinstance(entry[3], list)
        ):
            raise BadMessage(f"payload {i}: bad piece {entry!r}"[:200])
        size = sum(_nbytes(value, i) for value in entry[3])
        if at + size > len(view):
            raise BadMessage(f"payload {i}: ends inside piece {entry[:3]!r}")
        out.append((entry, view[at : at + size]))
        at += size
    if at != len(view):
        raise BadMessage(f"payload {i}: {len(view) - at} bytes left over after the pieces")
    return out


def _held(ranges: list[tuple[int, int]], a: int, b: int, same: bool) -> bool:
    """Whether ``ranges`` (sorted) hold every element of a..b; an empty piece (a
    parameter without elements, whose piece carries its per-tensor values) only when one
    of the same key was taken."""
    if a == b:
        return same
    for lo, hi in ranges:
        if lo > a:
            return False
        a = max(a, hi)
        if a >= b:
            return True
    return False


def _nbytes(value: Any, i: int) -> int:
    """The bytes a header value's tensor takes in the body (0 for a plain value)."""
    if not isinstance(value, list) or len(value) < 2 or value[1] != "tensor":
        return 0
    dtype = _DTYPES.get(value[2]) if len(value) == 4 else None
    if dtype is None or not _shape(value[3]):
        raise BadMessage(f"payload {i}: bad value {value!r}"[:200])
    return math.prod(value[3]) * dtype.itemsize


def _entry(entry: Any, sizes: Sequence[int]) -> tuple[int, int, int, list[Any]]:
    if not isinstance(entry, list) or len(entry) != 4 or not isinstance(entry[3], list):
        raise BadMessage(f"bad piece {entry!r}"[:200])
    t, a, b, values = entry
    if not all(type(x) is int for x in (t, a, b)) or not 0 <= t < len(sizes):
        raise BadMessage(f"piece {entry[:3]!r} names no parameter of {len(sizes)}")
    if not 0 <= a <= b <= sizes[t]:
        raise BadMessage(f"piece {entry[:3]!r} is outside parameter {t} of {sizes[t]} elements")
    return t, a, b, values


def _value(value: Any, t: int) -> list[Any]:
    if not isinstance(value, list) or len(value) < 3 or not isinstance(value[0], str):
        raise BadMessage(f"parameter {t}: bad value {value!r}"[:200])
    return value


def _shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
