"""SnapshotStore.export_into: a step's blob read into memory the caller keeps (the node
agent's export of a due step, which its worker waits for)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_layout import HEADER
from keepstep.elastic.snapshot_store import FileBuffer, MemoryBuffer, SnapshotBuffer, SnapshotStore


def _commit(store: SnapshotStore, step: int) -> None:
    store.commit(step, {"w": torch.arange(1000, dtype=torch.float32) * step}, b"meta")
    store.wait(30.0)


class Pool:
    """One kept bytearray, as the agent's ExportBuffers keeps one per member."""

    def __init__(self) -> None:
        self.kept: bytearray | None = None
        self.sizes: list[int] = []

    def alloc(self, n: int) -> bytearray:
        self.sizes.append(n)
        if self.kept is None or len(self.kept) != n:
            self.kept = bytearray(n)
        return self.kept


def test_export_into_gives_exports_bytes_in_the_callers_memory(buffer: SnapshotBuffer) -> None:
    store = SnapshotStore(buffer, background=False)
    pool = Pool()
    _commit(store, 3)
    first = store.export_into(3, pool.alloc)
    assert first is pool.kept and bytes(first) == store.export(3)
    _commit(store, 4)
    second = store.export_into(4, pool.alloc)
    assert second is first  # the same memory, overwritten with step 4
    assert bytes(second) == store.export(4) != store.export(3)
    # What it holds is a blob a peer imports.
    other = SnapshotStore(MemoryBuffer(), background=False)
    assert other.import_(second).step == 4
    assert torch.equal(other.load().tensors["w"], torch.arange(1000, dtype=torch.float32) * 4)
    store.close()


def test_export_into_checks_what_it_read(buffer: SnapshotBuffer) -> None:
    store = SnapshotStore(buffer, background=False)
    _commit(store, 3)
    _commit(store, 4)
    # Damage step 4's payload in the buffer: the bytes read out do not match its checksum.
    slot_size = struct.unpack_from("<Q", buffer.view(), 16)[0]
    slot = next(i for i in (0, 1) if store.infos()[0].slot == i)
    view = buffer.view()
    view[HEADER + slot * slot_size + HEADER + 100] ^= 0x01
    del view
    with pytest.raises(SnapshotCorrupt, match="step 4"):
        store.export_into(4, bytearray)
    assert bytes(store.export_into(3, bytearray)) == store.export(3)
    with pytest.raises(SnapshotMissing):
        store.export_into(5, bytearray)
    store.close()


def test_export_into_refuses_memory_of_another_size() -> None:
    store = SnapshotStore(MemoryBuffer(), background=False)
    _commit(store, 1)
    with pytest.raises(ConfigError, match=r"alloc\(\d+\) gave bytearray of 10 B: .* exactly"):
        store.export_into(1, lambda n: bytearray(10))
    with pytest.raises(ConfigError, match=r"gave b'x+': it must give a bytearray"):
        store.export_into(1, lambda n: b"x" * n)  # type: ignore[arg-type,return-value]
    store.close()


def test_export_into_gives_a_seeded_step() -> None:
    source = SnapshotStore(MemoryBuffer(), background=False)
    _commit(source, 6)
    blob = source.export(6)
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.seed(blob, 6)
    assert bytes(store.export_into(6, bytearray)) == blob
    source.close()
    store.close()


def test_a_file_buffer_reads_into_memory_and_refuses_past_its_end(tmp_path: Path) -> None:
    buffer = FileBuffer.create("snap", 4096, directory=tmp_path)
    buffer.view()[100:104] = b"abcd"
    out = bytearray(4)
    buffer.read_into(100, memoryview(out))
    assert out == b"abcd"
    with pytest.raises(SnapshotCorrupt, match=r"bytes 4094\.\.4098 are past its 4096 B"):
        buffer.read_into(4094, memoryview(out))
    memory = MemoryBuffer(8)
    with pytest.raises(SnapshotCorrupt, match="past its 8 B"):
        memory.read_into(6, memoryview(out))
    buffer.close()
