"""What the payload collectives' rounds share: the deadline left, and the length check.

Where it sits: under payloads.py (the ``Communicator``'s payload collectives). Its
``alltoall_tensors`` exchanges lengths in a first round and payloads in a second, under
one deadline; ``allgather_bytes`` sends each payload framed with its length (``framed``)
in the first round: one round when every payload fits (a member view, a shard
announcement: every epoch entry gathers them), a second of the payloads padded to the
longest otherwise. Every length a peer announces is checked here before a buffer is
allocated for it. Callers that repeat a collective of the same sizes (a sharded commit,
ZeRO's parameter gather) hand in buffers kept in a ``Buffers`` (``into=``), and send
payloads laid out in one (``laid_out``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from keepstep.elastic.errors import BadMessage, ConfigError

__all__ = [
    "EMPTY",
    "INLINE_BYTES",
    "PAD",
    "Alloc",
    "Buffers",
    "check_lengths",
    "check_max_bytes",
    "frame_length",
    "frame_payload",
    "framed",
    "laid_out",
    "left",
    "padded",
    "payload_sizes",
    "receive_buffer",
    "receive_like",
    "same_device",
    "slots",
    "sum_slices",
]

Alloc = Callable[[int], torch.Tensor]  # n bytes (1-D uint8) to receive into: fresh or kept
EMPTY = torch.empty(0, dtype=torch.uint8)  # an empty payload
PAD = torch.zeros(1, dtype=torch.uint8)  # after each payload: gloo moves no empty slices
# An allgather_bytes payload up to this long goes in its length's round (a frame of
# 8 + INLINE_BYTES bytes a member): member views and shard announcements are well inside.
INLINE_BYTES = 8192
_LENGTH = 8  # a frame's little-endian int64 length, before the payload


def left(deadline: float) -> timedelta:
    """What is left until ``deadline`` (``time.monotonic``), at least a millisecond: a
    spent deadline should time the next round out, not be refused as an invalid timeout."""
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def check_max_bytes(max_bytes: object) -> None:
    """``ConfigError`` unless ``max_bytes`` (a payload collective's bound) is an int >= 1."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ConfigError(f"max_bytes must be an int >= 1, got {max_bytes!r}")


def payload_sizes(
    payloads: Sequence[torch.Tensor], size: int, device: torch.device
) -> tuple[list[int], torch.device]:
    """The lengths of an alltoall's ``payloads``, one per rank of ``size``, and the device
    they share: ``ConfigError`` unless they are that many 1-D uint8 tensors, all on the CPU
    or all on the communicator's ``device``."""
    if len(payloads) != size:
        raise ConfigError(f"alltoall needs {size} payloads, got {len(payloads)}")
    if any(p.dtype != torch.uint8 or p.dim() != 1 for p in payloads):
        raise ConfigError("alltoall_tensors sends 1-D uint8 tensors")
    home = payloads[0].device
    homes = {str(p.device) for p in payloads}
    allowed = (home.type == "cpu" or same_device(home, device)) and len(homes) == 1
    if not allowed:
        raise ConfigError(
            f"alltoall_tensors payloads are on {', '.join(sorted(homes))}: they must all be "
            f"on the CPU or all on the communicator's device ({device})"
        )
    return [p.numel() for p in payloads], home


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device: ``cuda`` (the current GPU) matches ``cuda:N``,
    which is what a tensor on it reports."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def padded(payload: bytes, n: int) -> torch.Tensor:
    """``payload`` as ``n`` uint8 (at least one: gloo gathers no empty tensor), zero-padded."""
    out = torch.zeros(max(n, 1), dtype=torch.uint8)
    if payload:
        out[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


def check_lengths(lengths: list[int], max_bytes: int, what: str = "allgather_bytes") -> None:
    """``BadMessage`` naming the first rank whose length is outside [0, max_bytes]."""
    for rank, n in enumerate(lengths):
        if not 0 <= n <= max_bytes:
            raise BadMessage(f"{what}: rank {rank} sent {n} bytes; allowed are 0 to {max_bytes}")


def framed(payload: bytes, inline: int = INLINE_BYTES) -> torch.Tensor:
    """``payload``'s frame for the first round of ``allgather_bytes``: its length as a
    little-endian int64, then its first ``inline`` bytes, zero-padded (8 + ``inline``
    bytes, the same on every member)."""
    frame = torch.zeros(_LENGTH + inline, dtype=torch.uint8)
    head = len(payload).to_bytes(_LENGTH, "little")
    frame[:_LENGTH] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    body = payload[:inline]
    if body:
        frame[_LENGTH : _LENGTH + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return frame


def frame_length(frame: torch.Tensor) -> int:
    """The length a peer's frame (``framed``'s) says its payload has, unchecked."""
    return int.from_bytes(frame[:_LENGTH].cpu().numpy().tobytes(), "little", signed=True)


def frame_payload(frame: torch.Tensor, n: int) -> bytes:
    """The first ``n`` payload bytes a frame carries (``n`` within its inline part)."""
    return frame[_LENGTH : _LENGTH + n].cpu().numpy().tobytes()


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
    wrong = out.dim() != 1 or out.numel() != n or out.dtype != torch.uint8
    if wrong or not same_device(out.device, device):
        raise ConfigError(f"into({n}) gave {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def receive_like(tensor: torch.Tensor, device: torch.device, into: Alloc | None) -> torch.Tensor:
    """A buffer of ``tensor``'s dtype and size to receive into: fresh, or ``into``'s bytes."""
    if into is None:
        return torch.empty_like(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    return receive_buffer(nbytes, device, into).view(tensor.dtype)


def sum_slices(got: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """A reduce-scatter's result: the ``size`` equal slices of ``got`` added into slice
    ``rank`` (this rank's own, received), the others in rank order."""
    parts = got.view(size, -1)
    total = parts[rank]
    for r in range(size):
        if r != rank:
            total += parts[r]
    return total


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

    def alloc(self, use: str, device: torch.device | str = "cpu") -> Alloc:
        """Buffers for ``use`` on ``device`` (a collective receives on its communicator's)."""
        where = torch.device(device)

        def get(n: int) -> torch.Tensor:
            kept = self._kept.get(use)
            if kept is None or kept.numel() != n or not same_device(kept.device, where):
                kept = self._kept[use] = torch.empty(n, dtype=torch.uint8, device=where)
            return kept

        return get
