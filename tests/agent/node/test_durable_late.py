"""The agent's durable checkpoints when the worker went on before the agent read a step."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from keepstep.agent.durable.writer import CheckpointError, CheckpointWriter, Part, latest_checkpoint
from keepstep.agent.node.durable import DurableCheckpoints, export_step
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.protocol.events import EventLog
from keepstep.elastic.snapshot_layout import released_step
from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

T = 30.0


def snapshot_file(path: Path, steps: list[int]) -> None:
    """A worker's snapshot file after committing `steps` (it keeps the newest two)."""
    buffer = FileBuffer.open(path) if path.exists() else FileBuffer.create(path)
    store = SnapshotStore(buffer, background=False)
    for step in steps:
        store.commit(step, {"w": torch.full((64,), float(step))}, b"meta")
    store.close()
    buffer.close()


def test_a_step_whose_slot_was_reused_is_reported_gone_at_once(tmp_path: Path) -> None:
    snapshot_file(tmp_path / "snap", [3, 4, 5])
    began = time.monotonic()
    assert export_step(tmp_path / "snap", 3) is None
    assert time.monotonic() - began < 1.0  # no waiting for a copy that will never land
    assert export_step(tmp_path / "snap", 5) is not None


def test_a_due_step_gone_from_the_snapshot_is_checkpointed_late_not_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot_file(tmp_path / "snap", [3, 4, 5])
    url = f"file://{tmp_path}/ckpt"
    events = EventLog(tmp_path / "events.jsonl")
    durable = DurableCheckpoints(lambda: CheckpointWriter(url, 3), events, steps=9)
    epoch = EpochRecord(0, ["n0/0", "n1/0"])
    with caplog.at_level(logging.WARNING, logger="keepstep.agent.node.durable"):
        durable.after_commit(tmp_path / "snap", 3, "n0/0", epoch)
        deadline = time.monotonic() + T
        while not durable.writer.written() and time.monotonic() < deadline:
            time.sleep(0.01)  # the write runs on the agent's thread
        # The cadence goes on from the late one: step 6 is due and written.
        snapshot_file(tmp_path / "snap", [6])
        durable.after_commit(tmp_path / "snap", 6, "n0/0", epoch)
        durable.close(T)
    events.close()
    assert [i.step for i in durable.writer.written()] == [5, 6]
    assert "step 3 left the snapshot before it was read; checkpointing step 5" in caplog.text
    submitted = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in submitted][:1] == [("checkpoint-submitted", 5)]


def test_a_held_step_is_checkpointed_however_late_its_agent_reads_it(tmp_path: Path) -> None:
    # The worker holds due step 4 (keepstep.init reads the cadence the agent sets): it
    # commits steps 5 and 6 without waiting for its agent, and then waits before it
    # overwrites step 4, until the agent, busy elsewhere, has read it.
    path = tmp_path / "snap"
    buffer = FileBuffer.create(path)
    store = SnapshotStore(buffer)
    committed: list[int] = []

    def worker() -> None:
        for step in range(3, 8):
            store.commit(step, {"w": torch.full((64,), float(step))}, b"meta")
            store.wait(T)
            if step == 4:
                store.hold(4, T)
            committed.append(step)

    thread = threading.Thread(target=worker)
    thread.start()
    deadline = time.monotonic() + T
    while committed[-1:] != [5] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the worker is on step 6 by now: waiting, or (unheld) past step 4
    assert committed == [3, 4, 5]
    url = f"file://{tmp_path}/ckpt"
    events = EventLog(tmp_path / "events.jsonl")
    durable = DurableCheckpoints(lambda: CheckpointWriter(url, 4), events, steps=9)
    durable.after_commit(path, 4, "n0/0", EpochRecord(0, ["n0/0", "n1/0"]))
    thread.join(T)
    durable.close(T)
    events.close()
    store.close()
    buffer.close()
    assert committed == [3, 4, 5, 6, 7]
    assert [i.step for i in durable.writer.written()] == [4]
    assert store.held_s == 0.0  # step 7's commit: the hold went with step 6's


def test_a_held_step_the_agent_does_not_write_is_released(tmp_path: Path) -> None:
    # Step 4 committed again after a rollback, written already: released unread.
    path = tmp_path / "snap"
    snapshot_file(path, [4])
    url = f"file://{tmp_path}/ckpt"
    writer = lambda: CheckpointWriter(url, 4, after_step=8)  # noqa: E731
    events = EventLog(tmp_path / "events.jsonl")
    durable = DurableCheckpoints(writer, events, steps=12)
    durable.after_commit(path, 4, "n0/0", EpochRecord(0, ["n0/0"]))
    durable.close(T)
    events.close()
    assert released(path) == 4
    assert durable.writer.written() == []


def test_an_export_releases_the_step_found_or_gone(tmp_path: Path) -> None:
    path = tmp_path / "snap"
    snapshot_file(path, [4, 5, 6])
    assert export_step(path, 4) is None
    assert released(path) == 4
    assert export_step(path, 6) is not None
    assert released(path) == 6


def released(path: Path) -> int:
    buffer = FileBuffer.open(path)
    try:
        return released_step(buffer.view())
    finally:
        buffer.close()


def test_a_node_fails_on_its_newest_checkpoint_write_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # n0/0's part of step 4 (a sharded epoch led by another member) failed; then n0/0
    # led the epoch and wrote step 8 with the node's other writer: the job's checkpoints
    # are fine, and the node does not fail for the old part.
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")  # a file where the part's directory should be
    urls = iter([f"file://{tmp_path}/ckpt", f"file://{blocker}/ckpt"])
    events = EventLog(tmp_path / "events.jsonl")
    durable = DurableCheckpoints(lambda: CheckpointWriter(next(urls), 4), events, steps=12)
    durable._part_writer("n0/0").submit(4, b"part", Part(0, 1, 2))
    durable.writer.submit(8, b"whole")
    with caplog.at_level(logging.WARNING, logger="keepstep.agent.node.durable"):
        durable.close(T)
    assert "checkpoint of step 4" in caplog.text and "step 8 was written since" in caplog.text
    # Its newest write failing is the node's failure.
    urls = iter([f"file://{blocker}/ckpt"])
    durable = DurableCheckpoints(lambda: CheckpointWriter(next(urls), 4), events, steps=12)
    durable.writer.submit(8, b"whole")
    with pytest.raises(CheckpointError, match="checkpoint of step 8"):
        durable.close(T)
    events.close()


def test_the_agent_exports_into_memory_it_keeps_between_checkpoints(tmp_path: Path) -> None:
    path = tmp_path / "snap"
    url = f"file://{tmp_path}/ckpt"
    events = EventLog(tmp_path / "events.jsonl")
    durable = DurableCheckpoints(lambda: CheckpointWriter(url, 2), events, steps=8)
    epoch = EpochRecord(0, ["n0/0"])
    written: dict[int, bytes] = {}
    for step in (2, 4, 6):
        snapshot_file(path, [step - 1, step])
        durable.after_commit(path, step, "n0/0", epoch)
        deadline = time.monotonic() + T
        while len(durable.writer.written()) < len(written) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        found = latest_checkpoint(url, T)
        assert found is not None and found[0].step == step
        written[step] = found[1]
        # Written, its memory is kept for the next export of this member.
        assert durable.buffers.idle_bytes() == len(found[1])
    durable.close(T)
    events.close()
    assert durable.buffers.reused == 2  # steps 4 and 6 went into step 2's memory
    buffer = FileBuffer.open(path)
    store = SnapshotStore(buffer, background=False)
    assert written[6] == store.export(6)  # the kept memory held step 6, not a stale step
    assert written[2] != written[4] != written[6]
    store.close()
    buffer.close()
