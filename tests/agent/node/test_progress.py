"""The progress publisher: rate-limited in the background, complete on flush."""

from __future__ import annotations

import time

from keepstep.agent import protocol
from keepstep.agent.kv.memory import MemoryKV
from keepstep.agent.node.progress import FOLLOWER_INTERVAL_S, MIN_INTERVAL_S, ProgressPublisher

KEY = "/keepstep/job/progress/n0"


def published_step(kv: MemoryKV) -> int | None:
    kv_ = kv.get(KEY, 1.0)
    return None if kv_ is None else protocol.decode(protocol.ProgressRecord, kv_.value).step


def commit(step: int, epoch: int = 0) -> dict[str, int]:
    return {"step": step, "epoch": epoch, "world_size": 4}


def wait_for(kv: MemoryKV, step: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while published_step(kv) != step:
        assert time.monotonic() < deadline, published_step(kv)
        time.sleep(0.01)


def test_background_writes_are_rate_limited_but_flush_writes_the_newest() -> None:
    kv = MemoryKV()
    pub = ProgressPublisher(kv, KEY, "n0", global_batch=48, timeout=1.0)
    pub.start()
    try:
        pub.record(commit(0))
        wait_for(kv, 1)
        # Commits right after a write wait out the interval in the background...
        for step in range(1, 5):
            pub.record(commit(step))
        assert published_step(kv) == 1
        # ...but a flush (a worker's finish) puts the last one in at once.
        pub.flush()
        assert published_step(kv) == 5
        time.sleep(MIN_INTERVAL_S * 2)
        assert published_step(kv) == 5
    finally:
        pub.stop()


def test_flush_without_commits_writes_nothing() -> None:
    kv = MemoryKV()
    pub = ProgressPublisher(kv, KEY, "n0", global_batch=48, timeout=1.0)
    pub.flush()
    assert published_step(kv) is None


def test_a_commit_in_a_later_epoch_closes_the_recovery() -> None:
    kv = MemoryKV()
    pub = ProgressPublisher(kv, KEY, "n0", global_batch=48, timeout=1.0)
    assert pub.record(commit(0)) is None
    pub.fault(0)
    assert pub.record(commit(1, epoch=0)) is None
    mttr = pub.record(commit(1, epoch=1))
    assert mttr is not None and mttr >= 0
    pub.flush()
    kv_ = kv.get(KEY, 1.0)
    assert kv_ is not None
    record = protocol.decode(protocol.ProgressRecord, kv_.value)
    assert (record.step, record.epoch, record.last_mttr_s) == (2, 1, mttr)


def test_a_follower_publishes_seldom_until_its_node_leads() -> None:
    kv = MemoryKV()
    pub = ProgressPublisher(kv, KEY, "n0", global_batch=48, timeout=1.0)
    pub.start()
    try:
        pub.record(commit(0), leads=False)
        wait_for(kv, 1)
        for step in range(1, 4):
            pub.record(commit(step), leads=False)
        # A leader would have written step 4 by now (MIN_INTERVAL_S); a follower waits
        # out FOLLOWER_INTERVAL_S.
        time.sleep(MIN_INTERVAL_S * 3)
        assert published_step(kv) == 1
        # Its node leads the next epoch: it publishes at the leader's rate at once.
        started = time.monotonic()
        pub.record(commit(4, epoch=1), leads=True)
        wait_for(kv, 5)
        assert time.monotonic() - started < FOLLOWER_INTERVAL_S - MIN_INTERVAL_S * 3
    finally:
        pub.stop()
