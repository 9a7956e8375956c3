"""The snapshot transfer on entering an epoch: what a peer announces is bounded before
anything is allocated, and a snapshot within the bound arrives whole, in chunks."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import HashStore

from keepstep.elastic.comm import Communicator
from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.rollback import ResumePlan
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.transfer import (
    SNAPSHOT_SLACK_BYTES,
    broadcast_bytes,
    snapshot_limit,
    transfer_snapshot,
)

T = timedelta(seconds=5)


class Receiver:
    """Rank 1 of two: each broadcast overwrites its tensor with what rank 0 sends."""

    rank, size, device = 1, 2, torch.device("cpu")

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


def test_a_snapshot_crosses_in_chunks_of_the_given_size() -> None:
    blob = bytes(range(256)) * 4 + b"tail"
    chunks = [blob[lo : lo + 100] for lo in range(0, len(blob), 100)]
    comm = Receiver(
        [torch.tensor([len(blob)])]
        + [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in chunks]
    )
    store = Store()
    assert transfer_snapshot(comm, store, PLAN, len(blob), T, chunk_bytes=100)  # type: ignore[arg-type]
    assert comm.shapes == [(1,)] + [(len(c),) for c in chunks]  # 11 broadcasts, the last short
    assert store.imported == [blob]


class Sender:
    """Rank 0 of two: records what each broadcast sends."""

    rank, size, device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: Any = None) -> None:
        assert src == 0
        self.sent.append(tensor.numpy().tobytes())


def test_the_source_sends_chunks_of_its_blob_and_keeps_nothing() -> None:
    blob = bytes(range(200))
    sender = Sender()
    assert broadcast_bytes(sender, blob, 200, 0, T, chunk_bytes=64) is None  # type: ignore[arg-type]
    assert [len(c) for c in sender.sent] == [64, 64, 64, 8]
    assert b"".join(sender.sent) == blob
    with pytest.raises(ConfigError, match=r"a blob of 200 bytes, but 201 were announced"):
        broadcast_bytes(sender, blob, 201, 0, T)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"chunk_bytes=0: must be >= 1"):
        broadcast_bytes(sender, blob, 200, 0, T, chunk_bytes=0)  # type: ignore[arg-type]


def test_three_members_over_gloo_receive_a_store_snapshot_in_chunks() -> None:
    """A real snapshot from a real store, over three gloo ranks (threads): the needy rank
    imports it and loads the same tensors; the bystander receives but imports nothing."""
    source = SnapshotStore(MemoryBuffer(), background=False)
    tensors = {"w": torch.randn(300, dtype=torch.float64), "b": torch.arange(7)}
    source.commit(6, tensors, b"meta")
    stores = [source, SnapshotStore(MemoryBuffer()), SnapshotStore(MemoryBuffer())]
    plan = ResumePlan(resume_step=6, source=0, needy=(2,), reason="a joiner")
    members, hash_store = ["a", "b", "c"], HashStore()
    got: dict[int, object] = {}

    def member(rank: int) -> None:
        comm = Communicator.create(hash_store, 0, members, members[rank], timeout=T)
        try:
            got[rank] = transfer_snapshot(comm, stores[rank], plan, 1 << 20, T, chunk_bytes=512)
        except Exception as e:  # shown by the assertion below
            got[rank] = e
        finally:
            comm.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert got == {0: False, 1: False, 2: True}
    loaded = stores[2].load(6)
    assert loaded.meta == b"meta" and sorted(loaded.tensors) == ["b", "w"]
    assert all(torch.equal(loaded.tensors[k], v) for k, v in tensors.items())
    assert stores[1].infos() == []
    for store in stores:
        store.close()
