"""Plain Python values as JSON, exactly and unambiguously: a snapshot's meta on the wire.

Where it sits: `train_state.capture` encodes the plain part of a training state (param
groups, non-tensor optimizer state, tracked objects' plain state) with `dumps`, and
`train_state.load_meta` reads it back with `loads`. A snapshot may come from a peer over the
network or from any checkpoint URL, so what is read builds data only: never objects,
never code (no pickle).

JSON alone cannot say tuple, set, bytes, complex or a dict with non-string keys (optimizer
state is keyed by parameter index), so every container but a list is tagged: a JSON
object always has exactly one key, naming what it holds::

    {"d": [[key, value], ...]}   dict (keys of any plain type, in order)
    {"t": [...]}  tuple          {"s": [...]}  set           {"f": [...]}  frozenset
    {"b": "<base64>"}  bytes     {"c": [real, imag]}  complex

Floats round-trip exactly (shortest repr), infinities and NaN included; ints of any size.
Nesting deeper than `MAX_DEPTH` is refused on both sides.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

__all__ = ["MAX_DEPTH", "PlainJSONError", "dumps", "loads"]

MAX_DEPTH = 100


class PlainJSONError(ValueError):
    """The value is not plain data, or the text is not what `dumps` writes."""


def dumps(value: Any) -> bytes:
    """`value` (None, bool, int, float, str, bytes, complex and list, tuple, set,
    frozenset, dict of those) as compact JSON."""
    return json.dumps(_encode(value, 0), separators=(",", ":")).encode()


def loads(raw: bytes) -> Any:
    """What `dumps` wrote; PlainJSONError for anything else."""
    try:
        tree = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise PlainJSONError(f"not JSON: {e}") from None
    return _decode(tree, 0)


def _encode(value: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise PlainJSONError(f"nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_encode(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"t": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, frozenset):
        return {"f": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, set):
        return {"s": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode()}
    if isinstance(value, complex):
        return {"c": [value.real, value.imag]}
    raise PlainJSONError(f"a {type(value).__name__} is not plain data")


def _decode(tree: Any, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise PlainJSONError(f"nested deeper than {MAX_DEPTH}")
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, list):
        return [_decode(v, depth + 1) for v in tree]
    if not isinstance(tree, dict) or len(tree) != 1:
        raise PlainJSONError("an object must have exactly one tag key")
    ((tag, body),) = tree.items()
    try:
        if tag == "d" and isinstance(body, list):
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise PlainJSONError("a dict item must be [key, value]")
                out[_decode(pair[0], depth + 1)] = _decode(pair[1], depth + 1)
            return out
        if tag in ("t", "s", "f") and isinstance(body, list):
            items = [_decode(v, depth + 1) for v in body]
            return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
        if tag == "b" and isinstance(body, str):
            return base64.b64decode(body, validate=True)
        if tag == "c" and isinstance(body, list) and len(body) == 2:
            real, imag = body
            if isinstance(real, int | float) and isinstance(imag, int | float):
                return complex(real, imag)
    except (TypeError, binascii.Error) as e:  # an unhashable key or member; bad base64
        raise PlainJSONError(f"malformed {tag!r}: {e}") from None
    raise PlainJSONError(f"unknown or malformed tag {tag!r}")
