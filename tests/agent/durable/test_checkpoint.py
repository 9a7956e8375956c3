"""Tests of keepstep.agent.durable.writer: durable checkpoints on file:// and on a real S3 server.

The s3:// cases talk to moto's standalone server on loopback (tests/s3server.py) through
s3fs, as a job would talk to a bucket. Slow or stuck storage is a registered fsspec filesystem
(``gatedmem://``) that holds chosen operations until the test lets them go.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from keepstep.agent.durable.storage import part_name
from keepstep.agent.durable.writer import (
    LATEST,
    CheckpointError,
    CheckpointWriter,
    blob_name,
    info_name,
    latest_checkpoint,
    list_checkpoints,
)
from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.train_state import capture, restore
from s3server import S3Server

T = 30.0  # generous timeout for each blocking call; the tests take milliseconds
BUCKET = "keepstep-ckpt"


# -- storage under test ------------------------------------------------------------------------


@dataclass
class Target:
    url: str
    options: dict[str, Any]

    @property
    def fs(self) -> Any:
        return fsspec.core.url_to_fs(self.url, **self.options)[0]

    def _path(self, name: str) -> str:
        return f"{fsspec.core.url_to_fs(self.url, **self.options)[1]}/{name}"

    def names(self) -> set[str]:
        fs, root = fsspec.core.url_to_fs(self.url, **self.options)
        fs.invalidate_cache(root)
        return {str(p).rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}

    def read(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(name)))

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(name), data)

    def remove(self, name: str) -> None:
        self.fs.rm_file(self._path(name))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server.start(timeout=60)
    try:
        fsspec.filesystem("s3", **server.storage_options()).mkdir(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "file":
        return Target(f"file://{tmp_path}/ckpt", {})
    server: S3Server = request.getfixturevalue("s3")
    return Target(f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt", server.storage_options())


class Gate:
    """Holds the ``after``-th and later ``op`` on a name ending in ``suffix`` until released."""

    def __init__(self, op: str, suffix: str, after: int = 0) -> None:
        self.op, self.suffix, self.after = op, suffix, after
        self.entered = threading.Event()
        self.released = threading.Event()

    def hold(self, op: str, path: str) -> None:
        if op == self.op and path.endswith(self.suffix):
            if self.after > 0:
                self.after -= 1
                return
            self.entered.set()
            assert self.released.wait(T), "test never released the gate"


class GatedFS(MemoryFileSystem):  # type: ignore[misc]
    protocol = ("gatedmem",)
    store: dict[str, Any] = {}  # noqa: RUF012 (fsspec's own class attribute)
    pseudo_dirs = [""]  # noqa: RUF012

    def __init__(self, *args: Any, gate: Gate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    @classmethod
    def _strip_protocol(cls, path: str) -> Any:
        return super()._strip_protocol(path.removeprefix("gatedmem://"))

    def pipe_file(self, path: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        self.gate.hold("put", path)
        super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.gate.hold("get", path)
        return super().cat_file(path, *args, **kwargs)


fsspec.register_implementation("gatedmem", GatedFS, clobber=True)


def _gated(gate: Gate) -> Target:
    return Target(f"gatedmem://{uuid.uuid4().hex}", {"gate": gate})


def _blob(step: int, size: int = 1000) -> bytes:
    return hashlib.sha256(str(step).encode()).digest() * (size // 32) + bytes([step % 256])


def _write(t: Target, steps: list[int], **kwargs: Any) -> CheckpointWriter:
    writer = CheckpointWriter(t.url, 1, storage_options=t.options, **kwargs)
    for step in steps:
        writer.submit(step, _blob(step))
        writer.flush(T)
    return writer


# -- writing and reading back ------------------------------------------------------------------


def test_round_trip(target: Target) -> None:
    writer = CheckpointWriter(target.url, 5, storage_options=target.options)
    for step in (5, 10):
        assert writer.due(step)
        writer.submit(step, _blob(step))
        writer.flush(T)
    writer.close(T)

    found = latest_checkpoint(target.url, T, target.options)
    assert found is not None
    info, blob = found
    assert blob == _blob(10)
    assert info.step == 10 and info.nbytes == len(blob)
    assert info.sha256 == hashlib.sha256(blob).hexdigest()
    assert info.url == f"{target.url}/{blob_name(10)}"
    assert [i.step for i in writer.written()] == [5, 10]
    assert writer.written()[-1] == info
    assert list_checkpoints(target.url, T, target.options) == writer.written()
    assert target.names() == {blob_name(5), info_name(5), blob_name(10), info_name(10), LATEST}


def test_nothing_written_reads_as_none(target: Target) -> None:
    assert latest_checkpoint(target.url, T, target.options) is None
    assert list_checkpoints(target.url, T, target.options) == []


def test_due_counts_from_the_start_step(tmp_path: Path) -> None:
    writer = CheckpointWriter(f"file://{tmp_path}", 5)
    assert [s for s in range(21) if writer.due(s)] == [5, 10, 15, 20]
    writer.submit(10, b"x")  # queued, not yet written: already not due
    assert [s for s in range(21) if writer.due(s)] == [15, 20]
    with pytest.raises(ConfigError, match="step=10: checkpoint steps must increase"):
        writer.submit(10, b"y")
    with pytest.raises(ConfigError, match="blob: must be bytes or a bytearray, got memoryview"):
        writer.submit(15, memoryview(b"y"))  # type: ignore[arg-type]
    writer.submit(12, b"z")  # off the cadence on purpose (a final checkpoint): allowed
    writer.close(T)
    assert [i.step for i in writer.written()] in ([10, 12], [12])
    assert not writer.due(15)
    with pytest.raises(CheckpointError, match="closed"):
        writer.submit(15, b"z")

    resumed = CheckpointWriter(f"file://{tmp_path}", 5, after_step=10)
    assert [s for s in range(21) if resumed.due(s)] == [15, 20]
    resumed.close(T)


def test_burst_during_slow_write_keeps_newest(caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate("put", ".ckpt")
    t = _gated(gate)
    writer = CheckpointWriter(t.url, 1, storage_options=t.options)
    done: list[int] = []  # the steps whose blob the writer let go of, in order
    writer.submit(1, _blob(1), on_done=lambda: done.append(1))
    assert gate.entered.wait(T)  # step 1's blob is being written, and stays so
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="keepstep.agent.durable.writer"):
        for step in (2, 3, 4):
            writer.submit(step, _blob(step), on_done=lambda s=step: done.append(s))
    assert time.monotonic() - began < 1.0  # submit never waited for the write
    assert done == [2, 3]  # replaced: let go of at once, not when the write ends
    with pytest.raises(TimeoutError, match=r"step 4 .* not written after 0\.2 s"):
        writer.flush(0.2)
    gate.released.set()
    writer.close(T)
    assert done == [2, 3, 1, 4]

    assert [i.step for i in writer.written()] == [1, 4]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2
    assert "step 2 " in skipped[0] and "step 3 replaced it" in skipped[0]
    assert "step 3 " in skipped[1] and "step 4 replaced it" in skipped[1]
    found = latest_checkpoint(t.url, T, t.options)
    assert found is not None and found[0].step == 4 and found[1] == _blob(4)
    assert blob_name(2) not in t.names() and blob_name(3) not in t.names()


def test_a_step_queued_before_the_writer_woke_is_written_not_replaced(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Storage is idle, only the writer's thread has not run yet (a loaded machine): the
    steps submitted meanwhile are all written, none is skipped as if storage lagged."""
    t = Target(f"file://{tmp_path}/ckpt", {})
    writer = CheckpointWriter(t.url, 3, storage_options=t.options)
    with caplog.at_level(logging.WARNING, logger="keepstep.agent.durable.writer"):
        with writer._cond:  # the thread cannot take a step until both are queued
            writer.submit(3, _blob(3))
            writer.submit(6, _blob(6))
        writer.close(T)
    assert [i.step for i in writer.written()] == [3, 6]
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]


def test_a_bytearray_is_written_and_handed_back_once(target: Target) -> None:
    """The agent exports into memory it keeps (ExportBuffers): the writer takes a bytearray
    and says when it no longer reads it, written or failed."""
    blob = bytearray(_blob(7))
    done: list[int] = []
    writer = CheckpointWriter(target.url, 7, storage_options=target.options)
    writer.submit(7, blob, on_done=lambda: done.append(7))
    writer.flush(T)
    assert done == [7]
    found = latest_checkpoint(target.url, T, target.options)
    assert found is not None and found[0].step == 7 and found[1] == bytes(blob)
    writer.close(T)


def test_a_bytearray_whose_write_failed_is_handed_back(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")  # a file where the checkpoint directory should be
    done: list[int] = []
    writer = CheckpointWriter(f"file://{blocker}/ckpt", 1)
    writer.submit(1, bytearray(b"one"), on_done=lambda: done.append(1))
    with pytest.raises(CheckpointError, match=r"checkpoint of step 1 .* failed"):
        writer.flush(T)
    assert done == [1]
    writer.close(T)


def test_reader_does_not_see_a_checkpoint_before_latest_json() -> None:
    gate = Gate("put", LATEST, after=1)  # step 1 publishes; step 2 stops before latest.json
    t = _gated(gate)
    writer = CheckpointWriter(t.url, 1, storage_options=t.options)
    writer.submit(1, _blob(1))
    writer.flush(T)
    writer.submit(2, _blob(2))
    assert gate.entered.wait(T)
    assert {blob_name(2), info_name(2)} <= t.names()  # step 2 is whole but not published
    found = latest_checkpoint(t.url, T, t.options)
    assert found is not None and found[0].step == 1 and found[1] == _blob(1)
    assert [i.step for i in list_checkpoints(t.url, T, t.options)] == [1]
    gate.released.set()
    writer.close(T)
    found = latest_checkpoint(t.url, T, t.options)
    assert found is not None and found[0].step == 2


def test_files_without_latest_json_are_not_a_checkpoint(target: Target) -> None:
    blob = _blob(3)
    _write(target, [3]).close(T)
    record = target.read(info_name(3))
    target.remove(LATEST)  # as if the writer died before publishing its first checkpoint
    assert latest_checkpoint(target.url, T, target.options) is None
    assert list_checkpoints(target.url, T, target.options) == []
    target.write(LATEST, record)
    found = latest_checkpoint(target.url, T, target.options)
    assert found is not None and found[1] == blob


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-blob", "bad-record"])
def test_damaged_newest_falls_back(
    target: Target, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _write(target, [1, 2]).close(T)
    if damage == "flip":
        raw = bytearray(target.read(blob_name(2)))
        raw[len(raw) // 2] ^= 0x01
        target.write(blob_name(2), bytes(raw))
    elif damage == "truncate":
        target.write(blob_name(2), target.read(blob_name(2))[:-1])
    elif damage == "no-blob":
        target.remove(blob_name(2))
    else:
        target.write(info_name(2), b'{"format": 1, "step": 2, "sha256": "00"}')
        target.write(LATEST, b"{not json")
    with caplog.at_level(logging.WARNING, logger="keepstep.agent.durable.writer"):
        found = latest_checkpoint(target.url, T, target.options)
    assert found is not None
    assert found[0].step == 1 and found[1] == _blob(1)
    assert any("step 2" in r.getMessage() for r in caplog.records)


def test_every_checkpoint_damaged_is_an_error(target: Target) -> None:
    _write(target, [1, 2]).close(T)
    for step in (1, 2):
        target.write(blob_name(step), b"garbage")
    with pytest.raises(SnapshotCorrupt, match=r"no intact checkpoint.*sha256"):
        latest_checkpoint(target.url, T, target.options)
    for step in (1, 2):
        target.remove(blob_name(step))
    with pytest.raises(SnapshotMissing, match="no checkpoint is left"):
        latest_checkpoint(target.url, T, target.options)


def test_keep_prunes_oldest(target: Target) -> None:
    writer = _write(target, [1, 2])
    target.write(blob_name(1) + ".tmp-12345", b"half")  # a writer that died mid-file
    # Another agent's part of a newer step, still being written: not this writer's to delete.
    at_work = part_name(7, 0, 1, 2) + ".tmp-12346"
    target.write(at_work, b"half")
    for step in (3, 4):
        writer.submit(step, _blob(step))
        writer.flush(T)
    writer.close(T)
    assert target.names() == {
        blob_name(3),
        info_name(3),
        blob_name(4),
        info_name(4),
        LATEST,
        at_work,
    }
    target.remove(at_work)
    assert [i.step for i in list_checkpoints(target.url, T, target.options)] == [3, 4]
    assert [i.step for i in writer.written()] == [1, 2, 3, 4]

    _write(target, [5], keep=1).close(T)
    assert target.names() == {blob_name(5), info_name(5), LATEST}


def test_failed_write_surfaces_in_flush_and_clears(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")  # a file where the checkpoint directory should be
    url = f"file://{blocker}/ckpt"
    writer = CheckpointWriter(url, 1)
    writer.submit(1, b"one")
    with pytest.raises(CheckpointError, match=r"checkpoint of step 1 .* failed") as failed:
        writer.flush(T)
    assert isinstance(failed.value.__cause__, OSError)
    writer.flush(T)  # reported once
    blocker.unlink()
    writer.submit(2, b"two")
    writer.close(T)
    assert [i.step for i in writer.written()] == [2]
    found = latest_checkpoint(url, T)
    assert found is not None and found[1] == b"two"


def test_reader_times_out_on_stuck_storage() -> None:
    gate = Gate("get", LATEST)
    t = _gated(gate)
    _write(t, [1]).close(T)
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"reading checkpoints at gatedmem://.* 0\.2 s"):
        latest_checkpoint(t.url, 0.2, t.options)
    assert time.monotonic() - began < 2.0
    gate.released.set()


# -- a real snapshot through a checkpoint ------------------------------------------------------


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def test_snapshot_blob_round_trip(target: Target) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
    state = capture(3, model, opt)
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.commit(3, state.tensors, state.meta)
    blob = store.export(3)

    writer = CheckpointWriter(target.url, 3, storage_options=target.options)
    assert writer.due(3)
    writer.submit(3, blob)
    writer.close(T)
    found = latest_checkpoint(target.url, T, target.options)
    assert found is not None and found[1] == blob

    fresh = SnapshotStore(MemoryBuffer(), background=False)
    assert fresh.import_(found[1]).step == 3
    snap = fresh.load()
    assert snap.step == 3 and sorted(snap.tensors) == sorted(state.tensors)
    for name, t in state.tensors.items():
        assert snap.tensors[name].dtype == t.dtype and snap.tensors[name].shape == t.shape
        assert _bits(snap.tensors[name]) == _bits(t), name

    torch.manual_seed(1)
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    restore(snap, other, other_opt)
    again = capture(3, other, other_opt)
    assert again.tensors.keys() == state.tensors.keys()
    for name, t in state.tensors.items():
        assert _bits(again.tensors[name]) == _bits(t), name


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "url=''"),
        ("bogus://bucket/dir", "unknown protocol 'bogus'"),
        ("s3://", "url='s3://': names no directory"),
        ("file:///", "names no directory"),
        ("simplecache::s3://b/p", "chained URLs"),
        (42, "url=42"),
    ],
)
def test_bad_url_is_config_error(url: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        CheckpointWriter(url, 5)
    with pytest.raises(ConfigError, match=says):
        latest_checkpoint(url, T)
    with pytest.raises(ConfigError, match=says):
        list_checkpoints(url, T)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"every_steps": 0}, "every_steps=0: must be an int >= 1"),
        ({"every_steps": -3}, "every_steps=-3"),
        ({"every_steps": 2.5}, "every_steps=2.5"),
        ({"every_steps": True}, "every_steps=True"),
        ({"every_steps": 5, "keep": 0}, "keep=0: must be an int >= 1"),
        ({"every_steps": 5, "storage_options": ["key"]}, "storage_options=\\['key'\\]"),
    ],
)
def test_bad_writer_settings_are_config_errors(
    tmp_path: Path, kwargs: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        CheckpointWriter(f"file://{tmp_path}", **kwargs)


def test_bad_timeouts_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="timeout=0"):
        latest_checkpoint(f"file://{tmp_path}", 0)
    writer = CheckpointWriter(f"file://{tmp_path}", 1)
    with pytest.raises(ConfigError, match="timeout=-1"):
        writer.flush(-1)
    writer.close(T)
