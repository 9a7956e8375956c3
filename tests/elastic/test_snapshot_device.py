"""Snapshots of device tensors (snapshot_device.py): the slot mapping page-locked once and
again after it grows, a refusal leaving it pageable, registration on its own thread; on a
CUDA device, the copy on a side stream behind the commit's event, bit for bit."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from keepstep.elastic.snapshot_buffer import FileBuffer, MemoryBuffer
from keepstep.elastic.snapshot_device import DeviceCopier, Pinning
from keepstep.elastic.snapshot_store import SnapshotStore


class FakeHost:
    """Records registrations; refuses them when told to; checks they come in pairs."""

    def __init__(self, refuse: bool = False, block: threading.Event | None = None) -> None:
        self.refuse, self.block = refuse, block
        self.calls: list[tuple[str, int, int]] = []
        self.live: dict[int, int] = {}
        self.threads: set[str] = set()

    def register(self, ptr: int, size: int) -> None:
        self.threads.add(threading.current_thread().name)
        if self.block is not None:
            self.block.wait(10)
        self.calls.append(("register", ptr, size))
        if self.refuse:
            raise OSError("cudaHostRegister: CUDA error 2 (out of memory)")
        assert ptr not in self.live, "registered twice"
        self.live[ptr] = size

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr, self.live.pop(ptr)))


def address(buffer: FileBuffer | MemoryBuffer) -> tuple[int, int]:
    view = buffer.view()
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr(), len(view)


def test_the_mapping_is_locked_once_and_again_after_it_grows(tmp_path: Path) -> None:
    host = FakeHost()
    pin = Pinning(host)
    buffer = FileBuffer.create("slots", 1 << 16, directory=tmp_path)
    first = address(buffer)
    assert pin.ensure(buffer.view()) and pin.ensure(buffer.view())
    assert host.calls == [("register", *first)]  # the same mapping: once
    buffer.resize(1 << 17)  # a store grows its slots: a new mapping
    second = address(buffer)
    assert pin.ensure(buffer.view())
    assert host.calls[1:] == [("unregister", *first), ("register", *second)]
    pin.release()
    pin.release()
    assert host.calls[3:] == [("unregister", *second)] and host.live == {}
    assert host.threads and threading.current_thread().name not in host.threads
    buffer.close()


def test_a_refused_mapping_stays_pageable_and_is_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = FakeHost(refuse=True)
    pin = Pinning(host)
    buffer = MemoryBuffer(4096)
    with caplog.at_level(logging.WARNING):
        assert not pin.ensure(buffer.view())
        assert not pin.ensure(buffer.view())
    assert [c[0] for c in host.calls] == ["register"]
    assert "stay pageable" in caplog.text and "out of memory" in caplog.text
    pin.release()  # nothing was registered: nothing to unregister
    assert [c[0] for c in host.calls] == ["register"]
    buffer.resize(8192)  # a new mapping is tried again
    assert not pin.ensure(buffer.view())
    assert [c[0] for c in host.calls] == ["register", "register"]


def test_a_registration_that_hangs_leaves_the_copy_pageable() -> None:
    gate = threading.Event()
    pin = Pinning(FakeHost(block=gate), timeout=0.2)
    assert not pin.ensure(MemoryBuffer(4096).view())
    gate.set()


def test_a_store_unlocks_its_mapping_when_it_closes(tmp_path: Path) -> None:
    host = FakeHost()
    copier = DeviceCopier(host)
    buffer = FileBuffer.create("slots", directory=tmp_path)
    store = SnapshotStore(buffer, copier=copier)
    assert store.last_copy is None
    store.commit(1, {"w": torch.arange(10.0)}, b"")
    store.wait()
    assert host.calls == []  # CPU tensors: nothing to lock
    took = store.last_copy  # timed on the copy thread, read once durable
    assert took is not None and took.nbytes > 40 and min(took) >= 0
    copier.pinning.ensure(buffer.view())  # as the copy thread does for CUDA tensors
    store.close()
    assert [c[0] for c in host.calls] == ["register", "unregister"] and host.live == {}
    buffer.close()


def test_cpu_tensors_are_copied_without_marks() -> None:
    assert DeviceCopier.mark([torch.zeros(3), torch.ones(2)]) is None
    dsts = [torch.empty(3), torch.empty(2)]
    DeviceCopier(FakeHost()).copy(memoryview(b""), dsts, [torch.arange(3.0), torch.ones(2)], None)
    assert dsts[0].tolist() == [0.0, 1.0, 2.0] and dsts[1].tolist() == [1.0, 1.0]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_tensors_reach_the_slot_after_the_work_queued_before_the_commit(
    tmp_path: Path, pin: bool
) -> None:
    """The commit returns at once; the copy waits for the kernel queued before it (a sleep,
    then the write), and the slot holds exactly the written values."""
    buffer = FileBuffer.create("slots", directory=tmp_path)
    copier = DeviceCopier(pin=pin)
    store = SnapshotStore(buffer, copier=copier)
    x = torch.zeros(1 << 20, device="cuda")
    y = torch.arange(1000, dtype=torch.bfloat16, device="cuda")[::3]  # not contiguous
    for step in (1, 2, 3):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of a busy main stream
        x.fill_(step)
        store.commit(step, {"x": x, "y": y, "n": torch.tensor([step])}, b"m")
        store.wait()
        got = store.load(step).tensors
        assert torch.equal(got["x"], x.cpu()) and torch.equal(got["y"], y.cpu())
        assert got["n"].tolist() == [step]
    assert copier.pinning.pinned is pin
    store.close()
    assert not copier.pinning.pinned
    buffer.close()
