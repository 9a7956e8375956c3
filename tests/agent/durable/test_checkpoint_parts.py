"""A sharded job's durable checkpoint (durable/parts.py), on file:// and on a real S3 server.

Every member writes its snapshot as a part with its own writer, in parallel; the first
member's writer publishes the step once every part's record is in storage. A reader gets
one snapshot with every piece of the optimizer state; a part that never comes leaves the
step unpublished, and a damaged or missing part makes the reader fall back to the step
before, as a damaged whole checkpoint does.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import BUCKET, T, Target, s3  # noqa: F401 (s3: a fixture)

from keepstep.agent.durable.parts import PartsMissing, unbundle
from keepstep.agent.durable.writer import (
    LATEST,
    CheckpointError,
    CheckpointWriter,
    Part,
    blob_name,
    info_name,
    latest_checkpoint,
    list_checkpoints,
)
from keepstep.elastic.sharded import optimizer_sha256
from keepstep.elastic.sharded_checkpoint import join_parts
from shard_states import member_snapshots, state_of


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "file":
        return Target(f"file://{tmp_path}/ckpt", {})
    server = request.getfixturevalue("s3")
    return Target(f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt", server.storage_options())


def _checkpoint(t: Target, step: int, blobs: list[bytes], epoch: int = 1, **kw: Any) -> None:
    """Each member's part through its own writer, all at once; member 0 publishes."""
    writers = [CheckpointWriter(t.url, 1, storage_options=t.options, **kw) for _ in blobs]
    threads = [
        threading.Thread(
            target=w.submit, args=(step, blob, Part(epoch, i, len(blobs), publish=i == 0))
        )
        for i, (w, blob) in enumerate(zip(writers, blobs, strict=True))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    try:
        for w in writers:
            w.flush(T)
    finally:
        for w in writers:
            w.close(T)


def test_parts_written_in_parallel_read_back_as_the_whole_state(where: Target) -> None:
    members = ["n0/0", "n1/0", "n2/0"]
    blobs, full, params = member_snapshots(members, step=8)
    _checkpoint(where, 8, blobs)
    found = latest_checkpoint(where.url, T, where.options)
    assert found is not None
    info, blob = found
    assert (info.step, info.parts) == (8, 3)
    assert unbundle(blob) == blobs  # each part as written, joined where seeded
    state = state_of(join_parts(blobs), params)["state"]
    rebuilt = {"state": state, "param_groups": full["param_groups"]}
    assert optimizer_sha256(rebuilt) == optimizer_sha256(full)
    assert [c.step for c in list_checkpoints(where.url, T, where.options)] == [8]
    record = json.loads(where.read(info_name(8)))
    assert record["format"] == 2 and record["parts"] == 3  # older builds refuse, not misread
    manifest = json.loads(where.read(blob_name(8)))
    assert [p["name"] for p in manifest["parts"]] == [
        f"step-00000008.e0001.part-000{i}-of-0003.ckpt" for i in range(3)
    ]


def test_a_part_that_never_comes_leaves_the_step_before_in_force(tmp_path: Path) -> None:
    t = Target(f"file://{tmp_path}/ckpt", {})
    members = ["n0/0", "n1/0"]
    _checkpoint(t, 4, member_snapshots(members, step=4)[0])
    blobs = member_snapshots(members, step=8)[0]
    publisher = CheckpointWriter(t.url, 1, parts_timeout=0.3)
    publisher.submit(8, blobs[0], Part(2, 0, 2, publish=True))  # member 1 died before writing
    with pytest.raises(CheckpointError, match=r"1 of 2 parts not written after 0\.3 s") as caught:
        publisher.flush(T)
    assert isinstance(caught.value.__cause__, PartsMissing)
    publisher.close(T)
    found = latest_checkpoint(t.url, T)
    assert found is not None and found[0].step == 4
    assert json.loads(t.read(LATEST))["step"] == 4


def test_a_step_missing_a_part_gives_way_to_the_next_one(tmp_path: Path) -> None:
    # Member 1 could not export its part of step 4 (its snapshot had moved on); the
    # publisher must not wait out the parts timeout on it while step 8 is due.
    t = Target(f"file://{tmp_path}/ckpt", {})
    members = ["n0/0", "n1/0"]
    publisher = CheckpointWriter(t.url, 1, parts_timeout=300.0)
    publisher.submit(4, member_snapshots(members, step=4)[0][0], Part(1, 0, 2, publish=True))
    blobs = member_snapshots(members, step=8)[0]
    publisher.submit(8, blobs[0], Part(1, 0, 2, publish=True))
    other = CheckpointWriter(t.url, 1)
    other.submit(8, blobs[1], Part(1, 1, 2))
    other.close(T)
    publisher.close(T)  # well inside the 300 s a part is waited for
    found = latest_checkpoint(t.url, T)
    assert found is not None and (found[0].step, found[0].parts) == (8, 2)
    assert [c.step for c in list_checkpoints(t.url, T)] == [8]


def test_a_parts_memory_is_handed_back_before_the_other_parts_come(tmp_path: Path) -> None:
    # The agent exports into memory it keeps for the next export: the publisher lets go of
    # its part once the part is in storage, not after waiting for the others' parts.
    t = Target(f"file://{tmp_path}/ckpt", {})
    blobs = member_snapshots(["n0/0", "n1/0"], step=8)[0]
    publisher = CheckpointWriter(t.url, 1, parts_timeout=300.0)
    done = threading.Event()
    publisher.submit(8, bytearray(blobs[0]), Part(1, 0, 2, publish=True), on_done=done.set)
    assert done.wait(T)
    with pytest.raises(TimeoutError):
        publisher.flush(0.1)  # still waiting for part 1
    other = CheckpointWriter(t.url, 1)
    other.submit(8, blobs[1], Part(1, 1, 2))
    other.close(T)
    publisher.close(T)
    found = latest_checkpoint(t.url, T)
    assert found is not None and (found[0].step, found[0].parts) == (8, 2)


def test_the_publisher_sees_parts_written_by_other_processes(s3: Any) -> None:  # noqa: F811
    # Another agent's writer is another process with its own filesystem object: the
    # publisher's listing must not come from a cache made before that part arrived.
    t = Target(f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt", s3.storage_options())
    blobs = member_snapshots(["n0/0", "n1/0"], step=8)[0]
    publisher = CheckpointWriter(t.url, 1, storage_options=t.options, parts_timeout=15.0)
    publisher.submit(8, blobs[0], Part(1, 0, 2, publish=True))
    time.sleep(1.0)  # the publisher has listed the parts (one of two) by now
    elsewhere = {**t.options, "skip_instance_cache": True}
    other = CheckpointWriter(t.url, 1, storage_options=elsewhere)
    other.submit(8, blobs[1], Part(1, 1, 2))
    other.close(T)
    publisher.close(T)
    found = latest_checkpoint(t.url, T, t.options)
    assert found is not None and (found[0].step, found[0].parts) == (8, 2)


@pytest.mark.parametrize("damage", ["flip", "gone"])
def test_a_damaged_or_missing_part_falls_back(
    damage: str, where: Target, caplog: pytest.LogCaptureFixture
) -> None:
    members = ["n0/0", "n1/0"]
    old = member_snapshots(members, step=4)[0]
    _checkpoint(where, 4, old, epoch=0)
    _checkpoint(where, 8, member_snapshots(members, step=8)[0], epoch=3)
    part = "step-00000008.e0003.part-0001-of-0002.ckpt"
    if damage == "flip":
        raw = bytearray(where.read(part))
        raw[len(raw) // 2] ^= 0xFF
        where.write(part, bytes(raw))
    else:
        where.remove(part)
    found = latest_checkpoint(where.url, T, where.options)
    assert found is not None
    assert found[0].step == 4 and unbundle(found[1]) == old
    assert "skipping" in caplog.text and "step 8" in caplog.text


def test_pruning_takes_old_steps_parts_with_them(where: Target) -> None:
    members = ["n0/0", "n1/0", "n2/0"]
    for step in (4, 8, 12):
        _checkpoint(where, step, member_snapshots(members, step=step)[0], keep=2)
    names = where.names()
    assert not any(n.startswith("step-00000004") for n in names), names
    for step in (8, 12):
        assert sum(n.startswith(f"step-{step:08d}.e0001.part-") for n in names) == 6
    assert [c.step for c in list_checkpoints(where.url, T, where.options)] == [8, 12]


def test_a_bad_part_is_refused() -> None:
    with pytest.raises(ValueError, match=r"index=2: must be an int in 0..1"):
        Part(0, 2, 2)
    with pytest.raises(ValueError, match="count=0"):
        Part(0, 0, 0)
