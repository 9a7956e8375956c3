"""A step held for a reader stays in its slot until the reader releases it (bounded)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import Job, ScheduleController
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.snapshot_layout import FILE_STRUCT, HEADER
from keepstep.elastic.snapshot_store import FileBuffer, SnapshotStore

T = 30.0


def state(step: int, n: int = 64) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), float(step))}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "snap"


@pytest.fixture
def writer(path: Path) -> Iterator[SnapshotStore]:
    buffer = FileBuffer.create(path)
    store = SnapshotStore(buffer)
    yield store
    store.close()
    buffer.close()


class Reader:
    """Another mapping of the writer's file, as the node agent opens it."""

    def __init__(self, path: Path) -> None:
        self.buffer = FileBuffer.open(path)
        self.store = SnapshotStore(self.buffer, background=False)

    def close(self) -> None:
        self.buffer.close()


def commit(store: SnapshotStore, step: int, n: int = 64) -> None:
    store.commit(step, state(step, n), b"meta")
    store.wait(T)


def test_the_second_commit_after_a_held_step_waits_for_its_release(
    writer: SnapshotStore, path: Path
) -> None:
    commit(writer, 4)
    writer.hold(4, T)
    commit(writer, 5)  # the other slot: no wait
    assert writer.held_s == 0.0
    reader = Reader(path)
    read: list[bytes] = []

    def agent() -> None:
        time.sleep(0.3)  # the writer is waiting by now
        read.append(reader.store.export(4))
        reader.store.release(4)

    thread = threading.Thread(target=agent)
    thread.start()
    commit(writer, 6)  # would overwrite step 4
    thread.join(T)
    # The commit waited until the reader had read step 4 whole, then took its slot.
    assert read and writer.held_s >= 0.25
    assert [i.step for i in writer.infos()] == [6, 5]
    reader.close()


def test_a_released_step_is_not_waited_for(writer: SnapshotStore, path: Path) -> None:
    commit(writer, 4)
    writer.hold(4, T)
    reader = Reader(path)
    reader.store.release(4)  # the reader was quicker than the next commit
    reader.close()
    commit(writer, 5)
    commit(writer, 6)
    assert writer.held_s < 1.0
    assert [i.step for i in writer.infos()] == [6, 5]


def test_a_reader_that_never_releases_delays_one_commit_by_the_timeout(
    writer: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    commit(writer, 4)
    writer.hold(4, 0.3)
    commit(writer, 5)
    with caplog.at_level(logging.WARNING, logger="keepstep.elastic.snapshot_store"):
        commit(writer, 6)
        assert writer.held_s >= 0.3
        commit(writer, 7)  # the hold went with the overwrite
        assert writer.held_s == 0.0
    assert "step 4 was held 0.3 s for its reader" in caplog.text
    assert [i.step for i in writer.infos()] == [7, 6]


def test_releases_never_go_back(writer: SnapshotStore, path: Path) -> None:
    # A late release of an older step must not take back a newer one's.
    reader = Reader(path)
    reader.store.release(8)
    reader.store.release(4)
    commit(writer, 8)
    writer.hold(8, T)
    commit(writer, 9)
    commit(writer, 10)
    assert writer.held_s < 1.0
    reader.close()


def test_a_step_held_through_growth_is_kept(writer: SnapshotStore, path: Path) -> None:
    commit(writer, 4)
    writer.hold(4, T)
    commit(writer, 5, n=1 << 16)  # the slots grow; the held step is the newest and stays
    reader = Reader(path)
    assert torch.equal(reader.store.load(4).tensors["w"], state(4)["w"])
    reader.store.release(4)
    reader.close()
    commit(writer, 6, n=1 << 17)
    assert [i.step for i in writer.infos()] == [6, 5]


def test_a_seed_drops_the_hold(writer: SnapshotStore, path: Path) -> None:
    commit(writer, 4)
    blob = writer.export(4)
    commit(writer, 5)
    writer.hold(5, 0.5)
    writer.seed(blob, 4)  # the slots are emptied with the held step in them
    commit(writer, 5)
    commit(writer, 6)
    commit(writer, 7)
    assert writer.held_s == 0.0


@pytest.mark.parametrize(("step", "timeout"), [(-1, 1.0), (True, 1.0), (3, 0), (3, -2.0)])
def test_bad_holds_are_refused(writer: SnapshotStore, step: int, timeout: float) -> None:
    with pytest.raises(ConfigError, match=r"step=|timeout="):
        writer.hold(step, timeout)


# -- which steps a job's member holds ------------------------------------------------------


def held_steps(shard: str | None, env: dict[str, str]) -> dict[str, list[int]]:
    """Two members on threads train 6 steps; the steps each one's store was asked to hold."""
    names = ["a", "b"]
    store = HashStore()
    jobs, held = [], {name: [] for name in names}
    for me in names:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        controller = ScheduleController(store_=store, me=me, schedule=[names])
        job = keepstep.init(net, opt, data, 8, 2, 1, env=env, controller=controller, shard=shard)
        job.snapshots.hold = lambda step, timeout, me=me: held[me].append(step)  # type: ignore[method-assign]
        jobs.append((job, net))
    errors: list[BaseException] = []

    def train(job: Job, net: nn.Module) -> None:
        try:
            for step in job.steps(6):
                for mb in step.micro_batches():
                    step.backward(F.mse_loss(net(mb.inputs), mb.targets))
                step.commit()
            job.snapshots.close()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=train, args=pair) for pair in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return held


def test_the_members_whose_snapshots_are_checkpointed_hold_the_due_steps() -> None:
    every = {"KEEPSTEP_CHECKPOINT_EVERY": "2"}
    # A whole job's checkpoint is the first member's snapshot; a sharded job's are all.
    assert held_steps(None, every) == {"a": [2, 4, 6], "b": []}
    assert held_steps("zero1", every) == {"a": [2, 4, 6], "b": [2, 4, 6]}
    assert held_steps(None, {}) == {"a": [], "b": []}  # no durable checkpoints


def test_a_bad_cadence_is_refused() -> None:
    net = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="KEEPSTEP_CHECKPOINT_EVERY='x'"):
        keepstep.init(net, opt, data, 8, 2, env={"KEEPSTEP_CHECKPOINT_EVERY": "x"})
    with pytest.raises(ConfigError, match="checkpoint_every=0 must be an integer >= 1"):
        keepstep.init(net, opt, data, 8, 2, env={"KEEPSTEP_CHECKPOINT_EVERY": "0"})


def test_slot_steps_read_the_headers_alone(writer: SnapshotStore, path: Path) -> None:
    reader = Reader(path)
    assert reader.store.slot_steps() == []
    commit(writer, 4)
    commit(writer, 5)
    assert sorted(reader.store.slot_steps()) == [4, 5]
    view = reader.buffer.view()
    [slot] = [i.slot for i in reader.store.infos() if i.step == 5]
    slot_size = int(FILE_STRUCT.unpack_from(view, 0)[3])
    at = HEADER + slot * slot_size + HEADER + 100
    view[at] ^= 0xFF  # step 5's payload no longer checks out: still listed
    assert sorted(reader.store.slot_steps()) == [4, 5]
    assert [i.step for i in reader.store.infos()] == [4]
    del view
    reader.close()
