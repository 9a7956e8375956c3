"""Tests of keepstep.elastic.snapshot_store: slots, checksums, crashes, growth, other processes."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from snapshot_samples import sample_tensors

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_store import (
    FileBuffer,
    MemoryBuffer,
    SnapshotBuffer,
    SnapshotInfo,
    SnapshotStore,
)

HEADER = 64


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def _slot_at(buffer: SnapshotBuffer, slot: int) -> int:
    slot_size = struct.unpack_from("<Q", buffer.view(), 16)[0]
    return int(HEADER + slot * slot_size)


def _flip(buffer: SnapshotBuffer, at: int) -> None:
    view = buffer.view()
    view[at] ^= 0x01


class GatedBuffer(MemoryBuffer):
    """Blocks (or fails) the copy thread at its first view until the test opens the gate."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail

    def view(self) -> memoryview:
        if threading.current_thread() is not threading.main_thread():
            self.entered.set()
            assert self.gate.wait(30)
            if self.fail:
                raise OSError("simulated write failure")
        return super().view()


def test_round_trip_keeps_bits_dtypes_shapes_and_meta(buffer: SnapshotBuffer) -> None:
    with SnapshotStore(buffer) as store:
        want = sample_tensors(1)
        store.commit(1, want, b"meta-1")
        store.wait()
        snap = store.load()
    assert snap.step == 1 and snap.meta == b"meta-1"
    _assert_same(snap.tensors, want)
    buffer.close()


def test_each_slot_loads_its_own_step_and_newest_is_default() -> None:
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.commit(1, sample_tensors(1), b"one")
    store.commit(2, sample_tensors(2), b"two")
    assert [(i.step, i.slot) for i in store.infos()] == [(2, 1), (1, 0)]
    _assert_same(store.load(1).tensors, sample_tensors(1))
    _assert_same(store.load(2).tensors, sample_tensors(2))
    assert store.load().step == 2 and store.load(1).meta == b"one"
    with pytest.raises(SnapshotMissing, match="step 7"):
        store.load(7)
    # the third commit replaces the older slot, never the newest
    store.commit(3, sample_tensors(3), b"three")
    assert [(i.step, i.slot) for i in store.infos()] == [(3, 0), (2, 1)]


def test_newest_means_last_written_not_highest_step() -> None:
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.commit(5, sample_tensors(5), b"")
    store.commit(6, sample_tensors(6), b"")
    store.commit(5, sample_tensors(50), b"rolled back")  # a rollback re-commits an earlier step
    assert store.load().meta == b"rolled back"
    assert [i.step for i in store.infos()] == [5, 6]
    _assert_same(store.load(5).tensors, sample_tensors(50))


@pytest.mark.parametrize("where", ["payload", "tensor bytes", "header step"])
def test_corrupt_newest_slot_is_never_loaded(where: str) -> None:
    buffer = MemoryBuffer()
    store = SnapshotStore(buffer, background=False)
    store.commit(1, sample_tensors(1), b"one")
    store.commit(2, sample_tensors(2), b"two")
    at = _slot_at(buffer, 1)
    offset = {"payload": 2 * HEADER, "tensor bytes": HEADER + 600, "header step": 16}[where]
    _flip(buffer, at + offset)
    assert [i.step for i in store.infos()] == [1]
    snap = store.load()
    assert snap.step == 1
    _assert_same(snap.tensors, sample_tensors(1))
    if where != "header step":  # a flipped step no longer names step 2
        with pytest.raises(SnapshotCorrupt, match="checksum"):
            store.load(2)
        with pytest.raises(SnapshotCorrupt):
            store.export(2)
    # A store that did not write the newest slot checks it before keeping it: the next
    # commit (here by a restarted worker) overwrites the corrupt slot, not the intact one.
    restarted = SnapshotStore(buffer, background=False)
    restarted.commit(3, sample_tensors(3), b"three")
    assert [(i.step, i.slot) for i in restarted.infos()] == [(3, 1), (1, 0)]


def test_crash_mid_write_leaves_the_older_slot_loadable() -> None:
    buffer = GatedBuffer()
    store = SnapshotStore(buffer)
    buffer.gate.set()
    store.commit(1, sample_tensors(1), b"one")
    store.commit(2, sample_tensors(2), b"two")
    store.wait()
    buffer.gate.clear()
    store.commit(3, sample_tensors(3), b"three")
    assert buffer.entered.wait(30)
    # The writer "dies" here: its slot is marked WRITING and half overwritten.
    at = _slot_at(buffer, 0)
    view = super(GatedBuffer, buffer).view()
    view[at + HEADER : at + HEADER + 300] = b"\xab" * 300
    del view
    survivor = SnapshotStore(buffer)  # e.g. the restarted worker, on the same memory
    assert [i.step for i in survivor.infos()] == [2]
    _assert_same(survivor.load().tensors, sample_tensors(2))
    with pytest.raises(SnapshotMissing):
        survivor.load(3)
    buffer.gate.set()
    store.close()
    _assert_same(survivor.load().tensors, sample_tensors(3))
    survivor.close()


def test_commit_returns_before_the_background_copy_ends() -> None:
    buffer = GatedBuffer()
    store = SnapshotStore(buffer)
    big = {"w": torch.randn(1 << 20)}  # 4 MiB
    store.commit(1, big, b"")
    assert buffer.entered.wait(30)  # the copy has started and is held at the gate
    with pytest.raises(TimeoutError, match="still running"):
        store.wait(timeout=0.01)
    assert store.infos() == []
    buffer.gate.set()
    store.wait()
    assert [i.step for i in store.infos()] == [1]
    _assert_same(store.load(1).tensors, big)
    store.close()


def test_a_failed_copy_is_raised_once_and_never_loaded() -> None:
    buffer = GatedBuffer(fail=True)
    store = SnapshotStore(buffer)
    store.commit(1, sample_tensors(1), b"")
    buffer.gate.set()
    with pytest.raises(OSError, match="simulated"):
        store.wait()
    store.wait()  # latched once, not forever
    assert store.infos() == []
    with pytest.raises(SnapshotMissing):
        store.load()
    store.close()


def test_export_import_round_trip(tmp_path: Path) -> None:
    source = SnapshotStore(MemoryBuffer(), background=False)
    source.commit(4, sample_tensors(4), b"four")
    source.commit(5, sample_tensors(5), b"five")
    blob = source.export(4)
    target_buffer = FileBuffer.create("joiner", 0, directory=tmp_path)
    with SnapshotStore(target_buffer) as target:
        info = target.import_(blob)
        assert info == SnapshotInfo(
            step=4, slot=0, nbytes=len(blob) - HEADER, checksum=source.infos()[1].checksum
        )
        snap = target.load()
        assert snap.step == 4 and snap.meta == b"four"
        _assert_same(snap.tensors, sample_tensors(4))
        assert target.export(4) == blob  # the payload is a pure function of the state
    target_buffer.close()


@pytest.mark.parametrize("at", [HEADER + 100, 16, len(b"KSSLOT")])
def test_import_refuses_a_damaged_blob(at: int) -> None:
    source = SnapshotStore(MemoryBuffer(), background=False)
    source.commit(4, sample_tensors(4), b"four")
    blob = bytearray(source.export(4))
    blob[at] ^= 0x10
    target = SnapshotStore(MemoryBuffer(), background=False)
    with pytest.raises(SnapshotCorrupt):
        target.import_(bytes(blob))
    with pytest.raises(SnapshotCorrupt):
        target.import_(bytes(blob[: HEADER + 10]))
    assert target.infos() == []


@pytest.mark.parametrize("small_commits", [1, 2])
def test_growth_keeps_the_newest_snapshot(small_commits: int) -> None:
    # small_commits=2 puts the newest snapshot in slot 1, which moves when slots grow
    buffer = MemoryBuffer(4096)
    store = SnapshotStore(buffer)
    for step in range(small_commits):
        store.commit(step, sample_tensors(step, n=10), b"small")
    store.wait()
    newest = small_commits - 1
    big = sample_tensors(99, n=20_000)
    store.commit(small_commits, big, b"big")
    store.wait()
    assert buffer.size > 2 * 20_000 * 7 * 4
    assert [i.step for i in store.infos()] == [small_commits, newest]
    _assert_same(store.load(newest).tensors, sample_tensors(newest, n=10))
    _assert_same(store.load().tensors, big)
    store.commit(small_commits + 1, sample_tensors(7, n=20_000), b"")  # fits now: no growth
    store.wait()
    assert [i.step for i in store.infos()] == [small_commits + 1, small_commits]
    store.close()


def test_arguments_are_validated() -> None:
    store = SnapshotStore(MemoryBuffer(), background=False)
    t = {"w": torch.ones(2)}
    bad_calls: list[Callable[[], object]] = [
        lambda: store.commit(-1, t, b""),
        lambda: store.commit(True, t, b""),
        lambda: store.commit(1, {"w": [1.0]}, b""),  # type: ignore[dict-item]
        lambda: store.commit(1, {"": torch.ones(1)}, b""),
        lambda: store.commit(1, {"s": torch.ones(2).to_sparse()}, b""),
        lambda: store.commit(1, t, "meta"),  # type: ignore[arg-type]
        lambda: store.commit(1, t, b"", timeout=0),
        lambda: store.wait(timeout=-1),
        lambda: store.load(-2),
        lambda: MemoryBuffer(-1),
    ]
    for bad in bad_calls:
        with pytest.raises(ConfigError):
            bad()
    with pytest.raises(ConfigError, match=r"size=10: must be an int >= 100"):
        MemoryBuffer(100).resize(10)


def test_a_foreign_buffer_is_refused(tmp_path: Path) -> None:
    buffer = MemoryBuffer(256)
    buffer.view()[:8] = b"NOTOURS!"
    with pytest.raises(SnapshotCorrupt, match="magic"):
        SnapshotStore(buffer)
    path = tmp_path / "exists"
    FileBuffer.create(path, 10).close()
    with pytest.raises(FileExistsError):
        FileBuffer.create(path, 10)
    FileBuffer.open_or_create(path, 10).close()


def _child(path: str, step: int, seed: int) -> None:
    torch.set_num_threads(1)
    buffer = FileBuffer.open(path)
    store = SnapshotStore(buffer)
    snap = store.load()
    want = sample_tensors(seed)
    if (
        snap.step != step
        or snap.meta != b"parent"
        or any(not torch.equal(snap.tensors[k], v) for k, v in want.items())
    ):
        os._exit(3)
    store.commit(step + 1, {"big": torch.full((1 << 21,), 7.0)}, b"child")
    os._exit(0)  # dies with its copy possibly in flight: no wait(), no close()


@pytest.mark.slow
def test_another_process_loads_what_this_one_wrote_and_may_crash(tmp_path: Path) -> None:
    buffer = FileBuffer.create("shared", 0, directory=tmp_path)
    store = SnapshotStore(buffer)
    store.commit(1, sample_tensors(0), b"older")
    store.commit(2, sample_tensors(2), b"parent")
    store.close()
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_child, args=(str(buffer.path), 2, 2))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    # the child wrote over the older slot; whether or not its copy ended, step 2 is intact
    reader = SnapshotStore(FileBuffer.open(buffer.path))
    _assert_same(reader.load(2).tensors, sample_tensors(2))
    newest = reader.load()
    assert newest.step in (2, 3)
    if newest.step == 3:
        assert newest.meta == b"child" and bool((newest.tensors["big"] == 7.0).all())
    with pytest.raises(SnapshotMissing):
        reader.load(1)
    reader.close()
    buffer.close()
    buffer.unlink()
