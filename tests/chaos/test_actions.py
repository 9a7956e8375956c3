"""The injector's building blocks on real files and processes, without a training job."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from keepstep.agent.durable.storage import CheckpointInfo
from keepstep.chaos.actions import DutyCycle, Stopped, corrupt_newest_slot, send
from keepstep.chaos.rundir import CHECKPOINTS, RunView, alive, process_group
from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore
from keepstep.launch import cgroups


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def _wait_state(pid: int, wanted: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while (state := _state(pid)) not in wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.fixture
def node() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in node: a process group of its own."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    send(proc.pid, signal.SIGKILL, group=True)
    send(proc.pid, signal.SIGCONT, group=True)
    proc.wait(timeout=10)


def test_a_corrupted_newest_slot_is_refused_and_the_older_one_loads(tmp_path: Path) -> None:
    buffer = FileBuffer.create("snap", directory=tmp_path)
    store = SnapshotStore(buffer, background=False)
    store.commit(1, {"w": torch.full((256,), 1.0)}, b"one")
    store.commit(2, {"w": torch.full((256,), 2.0)}, b"two")
    store.close()
    buffer.close()

    detail = corrupt_newest_slot(tmp_path / "snap")
    assert detail["corrupted"] and detail["slot_step"] == 2 and detail["store_refuses_slot"]

    buffer = FileBuffer.open("snap", directory=tmp_path)
    try:
        store = SnapshotStore(buffer, background=False)
        assert [info.step for info in store.infos()] == [1]
        loaded = store.load()
        assert loaded.step == 1 and torch.equal(loaded.tensors["w"], torch.full((256,), 1.0))
        store.close()
    finally:
        buffer.close()


def test_a_snapshot_without_a_valid_slot_is_left_alone(tmp_path: Path) -> None:
    buffer = FileBuffer.create("snap", directory=tmp_path)
    SnapshotStore(buffer, background=False).close()
    buffer.close()
    before = (tmp_path / "snap").read_bytes()
    assert corrupt_newest_slot(tmp_path / "snap") == {
        "corrupted": False,
        "reason": "no valid slot yet",
    }
    assert (tmp_path / "snap").read_bytes() == before


def test_the_run_view_follows_appended_events(tmp_path: Path) -> None:
    log = tmp_path / "events-n0.jsonl"
    lines = [
        {"t": 1.0, "kind": "agent-started", "node": "n0", "pid": 11},
        {"t": 1.1, "kind": "worker-started", "member": "n0/0", "pid": 12},
        {"t": 2.0, "kind": "commit", "step": 0, "epoch": 0},
        {"t": 2.1, "kind": "commit", "step": 1, "epoch": 0},
        {"t": 2.2, "kind": "fault-detected", "cause": "worker-exit"},
        {"t": 2.3, "kind": "worker-exited", "member": "n0/0", "pid": 12, "code": -9},
    ]
    text = "".join(json.dumps(e) + "\n" for e in lines)
    cut = text.index('{"t": 2.1')
    log.write_text(text[: cut + 10])  # a line still being written is not read yet
    view = RunView(tmp_path)
    assert len(view.poll()) == 3
    assert (view.step, view.first_commit_t, view.agents) == (1, 2.0, {"n0": 11})
    assert view.worker_pid("n0") == 12
    with open(log, "a") as f:
        f.write(text[cut + 10 :])
    assert [e["kind"] for e in view.poll()] == ["commit", "fault-detected", "worker-exited"]
    assert (view.step, view.worker_pid("n0"), view.detections) == (2, None, [2.2])


def test_the_view_notes_each_step_record_and_skips_a_sharded_jobs_parts(tmp_path: Path) -> None:
    folder = tmp_path / CHECKPOINTS
    folder.mkdir()
    info = CheckpointInfo("file:///x/step-00000010.ckpt", 10, 5, "ab" * 32, 0.0, parts=4)
    (folder / "step-00000010.json").write_bytes(info.to_json())
    (folder / "step-00000010.e0000.part-0001-of-0004.json").write_bytes(info.to_json())
    (folder / "step-00000020.json").write_bytes(b"{")  # being written: the next poll decides
    view = RunView(tmp_path)
    view.poll()
    assert view.checkpoints == {10: "ab" * 32}


def test_a_hang_stops_the_group_and_resumes_it(node: subprocess.Popen[bytes]) -> None:
    send(node.pid, signal.SIGSTOP, group=True)
    hang = Stopped(node.pid)
    assert _wait_state(node.pid, "T") == "T"
    hang.end()
    assert _wait_state(node.pid, "SR") in "SR"
    assert process_group(node.pid) == [node.pid]


def test_a_duty_cycle_ends_with_the_node_running(node: subprocess.Popen[bytes]) -> None:
    cycle = DutyCycle(node.pid, share=0.5, period=0.1)
    assert _wait_state(node.pid, "T") == "T"  # stopped part of the time
    cycle.end()
    time.sleep(0.05)
    assert _state(node.pid) in "SR" and alive(node.pid)


@pytest.mark.skipif(cgroups.available("freezer") is not None, reason="no writable freezer")
def test_a_frozen_node_is_thawed_and_its_cgroup_removed(node: subprocess.Popen[bytes]) -> None:
    group = cgroups.Cgroup.create("freezer", f"keepstep-chaos-test-{node.pid}", node.pid)
    group.add([node.pid])
    group.freeze(True)
    assert group.pids() == [node.pid]
    Stopped(node.pid, group).end()
    assert not group.path.exists()
    assert _wait_state(node.pid, "SR") in "SR"


@pytest.mark.skipif(cgroups.available("cpu") is not None, reason="no writable cpu cgroup")
def test_a_throttled_node_is_put_back(node: subprocess.Popen[bytes]) -> None:
    group = cgroups.Cgroup.create("cpu", f"keepstep-chaos-test-{node.pid}", node.pid)
    group.limit_cpu(0.2)
    group.add([node.pid])
    assert group.pids() == [node.pid]
    group.release()
    assert not group.path.exists() and alive(node.pid)
