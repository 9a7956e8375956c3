"""The snapshot transfer on entering an epoch: what a peer announces is bounded before
anything is allocated, and a snapshot within the bound arrives whole."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from keepstep.elastic.errors import BadMessage
from keepstep.elastic.rollback import ResumePlan
from keepstep.elastic.transfer import SNAPSHOT_SLACK_BYTES, snapshot_limit, transfer_snapshot

T = timedelta(seconds=5)


class Receiver:
    """Rank 1 of two: each broadcast overwrites its tensor with what rank 0 sends."""

    rank, size = 1, 2

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent, self.shapes = list(sent), []

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: Any = None) -> None:
        assert src == 0
        self.shapes.append(tuple(tensor.shape))
        tensor.copy_(self.sent.pop(0))


class Store:
    def __init__(self) -> None:
        self.imported: list[bytes] = []

    def import_(self, blob: bytes) -> None:
        self.imported.append(blob)


PLAN = ResumePlan(resume_step=6, source=0, needy=(1,), reason="a joiner")


def test_an_announced_size_past_the_bound_is_refused_before_allocating() -> None:
    comm, store = Receiver([torch.tensor([1 << 40])]), Store()
    with pytest.raises(BadMessage, match=r"rank 0 announced a snapshot of 1099511627776 bytes"):
        transfer_snapshot(comm, store, PLAN, limit=1 << 20, timeout=T)  # type: ignore[arg-type]
    assert comm.shapes == [(1,)] and store.imported == []  # only the size was received


def test_a_snapshot_within_the_bound_arrives_whole() -> None:
    blob = bytes(range(256)) * 4
    comm = Receiver(
        [torch.tensor([len(blob)]), torch.frombuffer(bytearray(blob), dtype=torch.uint8)]
    )
    store = Store()
    assert transfer_snapshot(comm, store, PLAN, limit=len(blob), timeout=T)  # type: ignore[arg-type]
    assert store.imported == [blob]


def test_the_bound_follows_the_model() -> None:
    small, large = torch.nn.Linear(4, 4), torch.nn.Linear(512, 512)
    assert snapshot_limit(small) == 8 * (16 + 4) * 4 + SNAPSHOT_SLACK_BYTES
    assert snapshot_limit(large) - SNAPSHOT_SLACK_BYTES == 8 * (512 * 512 + 512) * 4
