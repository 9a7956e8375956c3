"""What the payload collectives' rounds share: the deadline left, and the length check.

Where it sits: under communicator.py, whose ``allgather_bytes`` and ``alltoall_tensors``
exchange lengths in a first round and payloads in a second, under one deadline. Every
length a peer announces is checked here before a buffer is allocated for it. Callers that
repeat a collective of the same sizes (a sharded commit, ZeRO's parameter gather) hand in
buffers kept in a ``Buffers`` (``into=``), and send payloads laid out in one (``laid_out``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch

from keepstep.elastic.errors import BadMessage, ConfigError

__all__ = [
    "EMPTY",
    "PAD",
    "Alloc",
    "Buffers",
    "check_lengths",
    "laid_out",
    "left",
    "receive_buffer",
    "slots",
]

Alloc = Callable[[int], torch.Tensor]  # n bytes (1-D uint8) to receive into: fresh or kept
EMPTY = torch.empty(0, dtype=torch.uint8)  # an empty payload
PAD = torch.zeros(1, dtype=torch.uint8)  # after each payload: gloo moves no empty slices


def left(deadline: float) -> timedelta:
    """What is left until ``deadline`` (``time.monotonic``), at least a millisecond: a
    spent deadline should time the next round out, not be refused as an invalid timeout."""
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def check_lengths(lengths: list[int], max_bytes: int, what: str = "allgather_bytes") -> None:
    """``BadMessage`` naming the first rank whose length is outside [0, max_bytes]."""
    for rank, n in enumerate(lengths):
        if not 0 <= n <= max_bytes:
            raise BadMessage(f"{what}: rank {rank} sent {n} bytes; allowed are 0 to {max_bytes}")


def laid_out(payloads: list[torch.Tensor]) -> torch.Tensor | None:
    """The one buffer ``payloads`` (1-D uint8) already lie in, each followed by its spare
    byte (``snapshot_pieces.pack_payloads``'s layout), or None: then they are copied
    together. Sent as it is, with no copy."""
    first = payloads[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    at = start
    for p in payloads:
        same = p.untyped_storage().data_ptr() == storage.data_ptr()
        if not same or p.storage_offset() != at or not p.is_contiguous():
            return None
        at += p.numel() + 1
    if at > storage.nbytes():
        return None
    return torch.as_strided(first, (at - start,), (1,), start)


def receive_buffer(n: int, device: torch.device, into: Alloc | None) -> torch.Tensor:
    """``n`` bytes on ``device`` to receive into: fresh, or ``into(n)``, checked."""
    out = torch.empty(n, dtype=torch.uint8, device=device) if into is None else into(n)
    if out.dim() != 1 or out.numel() != n or out.dtype != torch.uint8 or out.device != device:
        raise ConfigError(f"into({n}) gave {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def slots(
    mine: torch.Tensor, size: int, device: torch.device, into: Alloc | None
) -> list[torch.Tensor]:
    """An allgather's ``size`` output tensors like ``mine``: fresh, or views of ``into``'s
    buffer (``mine`` 1-D uint8)."""
    if into is None:
        return [torch.empty_like(mine) for _ in range(size)]
    return list(receive_buffer(mine.numel() * size, device, into).chunk(size))


class Buffers:
    """uint8 buffers kept from one call to the next, one per use: a collective's payloads
    often have the same sizes call after call (a sharded commit's, a parameter gather's),
    and memory written again is warm, where a fresh buffer is faulted in page by page. A
    buffer handed out is its holder's until the same use asks again; keep one ``Buffers``
    per epoch (a collective given up may still write into the last one's)."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def alloc(self, use: str) -> Alloc:
        def get(n: int) -> torch.Tensor:
            kept = self._kept.get(use)
            if kept is None or kept.numel() != n:
                kept = self._kept[use] = torch.empty(n, dtype=torch.uint8)
            return kept

        return get
