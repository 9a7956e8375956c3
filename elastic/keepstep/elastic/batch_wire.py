"""A collated batch as bytes of a fixed layout: how a loader worker hands one back.

Where it sits: a loader worker (data_workers.py) encodes each micro-batch it reads with
``encode``; the training process rebuilds it with ``decode``. Nothing is unpickled: what
is read builds tensors and plain containers only, never objects or code.

Layout: an 8-byte little-endian length, a JSON header of that length, then every tensor's
bytes back to back. The header is ``{"tree": node, "tensors": [[dtype, shape], ...]}``,
where a node is ``["T", i]`` (tensor i), ``["L", [nodes]]`` (list), ``["U", [nodes]]``
(tuple), ``["D", [[key node, value node], ...]]`` (dict) or ``["P", value]`` (None, bool,
int, float, str).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from keepstep.elastic.errors import KeepstepError

__all__ = ["decode", "encode"]

_MAX_DEPTH = 100


class BatchWireError(KeepstepError):
    """A batch holds what cannot travel, or the bytes are not what ``encode`` writes."""


def encode(batch: Any) -> bytes:
    tensors: list[torch.Tensor] = []

    def node(value: Any, depth: int) -> list[Any]:
        if depth > _MAX_DEPTH:
            raise BatchWireError(f"a batch nested deeper than {_MAX_DEPTH}")
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().to("cpu").contiguous())
            return ["T", len(tensors) - 1]
        if isinstance(value, list | tuple):
            return ["L" if isinstance(value, list) else "U", [node(v, depth + 1) for v in value]]
        if isinstance(value, dict):
            return ["D", [[node(k, depth + 1), node(v, depth + 1)] for k, v in value.items()]]
        if value is None or isinstance(value, bool | int | float | str):
            return ["P", value]
        raise BatchWireError(
            f"a batch holding a {type(value).__name__} cannot come back from a loader worker: "
            "tensors, lists, tuples, dicts and plain values only (collate_fn's output)"
        )

    tree = node(batch, 0)
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    header = json.dumps({"tree": tree, "tensors": specs}).encode()
    parts = [struct.pack("<Q", len(header)), header]
    parts += [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join(parts)


def decode(raw: bytes) -> Any:
    try:
        (size,) = struct.unpack_from("<Q", raw)
        header = json.loads(raw[8 : 8 + size])
        offset, tensors = 8 + size, []
        for name, shape in header["tensors"]:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise BatchWireError(f"no dtype {name!r}")
            count = 1
            for dim in shape:
                count *= int(dim)
            nbytes = count * dtype.itemsize
            if offset + nbytes > len(raw):
                raise BatchWireError("the tensors' bytes end early")
            if nbytes == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
            else:
                data = bytearray(raw[offset : offset + nbytes])
                tensors.append(torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape))
            offset += nbytes
        if offset != len(raw):
            raise BatchWireError("bytes left after the last tensor")
        return _build(header["tree"], tensors, 0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        raise BatchWireError(f"not a batch encode wrote: {error}") from None


def _build(tree: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise BatchWireError(f"a batch nested deeper than {_MAX_DEPTH}")
    kind, body = tree
    if kind == "T":
        return tensors[body]
    if kind in ("L", "U"):
        items = [_build(v, tensors, depth + 1) for v in body]
        return items if kind == "L" else tuple(items)
    if kind == "D":
        return {_build(k, tensors, depth + 1): _build(v, tensors, depth + 1) for k, v in body}
    if kind == "P" and (body is None or isinstance(body, bool | int | float | str)):
        return body
    raise BatchWireError(f"unknown node {kind!r}")
