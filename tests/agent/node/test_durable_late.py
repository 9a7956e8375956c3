"""The agent's durable checkpoints when the worker went on before the agent read a step."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

from keepstep.agent.durable.writer import CheckpointWriter
from keepstep.agent.node.durable import DurableCheckpoints, export_step
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.protocol.events import EventLog
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
