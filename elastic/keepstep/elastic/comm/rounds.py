"""What the payload collectives' rounds share: the deadline left, and the length check.

Where it sits: under communicator.py, whose ``allgather_bytes`` and ``alltoall_tensors``
exchange lengths in a first round and payloads in a second, under one deadline. Every
length a peer announces is checked here before a buffer is allocated for it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from keepstep.elastic.errors import BadMessage

__all__ = ["EMPTY", "PAD", "check_lengths", "left"]

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
