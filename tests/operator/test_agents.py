"""Reading a job's agent records and claiming its etcd prefix, over the in-memory KV fake."""

from __future__ import annotations

import json

from keepstep.agent import protocol
from keepstep.agent.kv.memory import MemoryKV
from keepstep.operator.actions import ClaimPrefix
from keepstep.operator.agents import AgentStore

JOB = "ns.demo"
T = 0.5


def put(kv: MemoryKV, kind: str, name: str, record: object) -> None:
    kv.put(protocol.key(JOB, kind, name), protocol.encode(record), T)


def test_records_decode_into_the_view() -> None:
    kv = MemoryKV()
    put(kv, "nodes", "demo-node-0", protocol.NodeRecord("demo-node-0", "10.0.0.1", 1, 2))
    put(kv, "progress", "demo-node-0", protocol.ProgressRecord("demo-node-0", 9, 2, 1, 40.0))
    put(kv, "done", "demo-node-0-0", protocol.DoneRecord("demo-node-0/0", 9, "ab" * 32))
    kv.put(
        protocol.key(JOB, "epoch"), protocol.encode(protocol.EpochRecord(2, ["demo-node-0/0"])), T
    )
    kv.put(
        protocol.key(JOB, "recoveries", "2-demo-node-0-0"),
        json.dumps({"epoch": 2, "restore_s": 0.1}).encode(),
        T,
    )
    kv.put(
        protocol.key(JOB, "recoveries", "3-demo-node-0-0"), json.dumps({"mttr_s": 0.25}).encode(), T
    )
    kv.put(protocol.key(JOB, "progress", "broken"), b"not json", T)
    kv.put(protocol.key("ns.other", "nodes", "x"), b"{}", T)  # another job's prefix
    clock = iter([100.0, 200.0])
    store = AgentStore(kv, T, clock=lambda: next(clock))
    view = store.read(JOB)
    assert list(view.nodes) == ["demo-node-0"] and view.epoch is not None
    assert view.epoch.epoch == 2 and view.progress["demo-node-0"].step == 9
    assert view.done["demo-node-0-0"].params_sha256 == "ab" * 32 and view.complete()
    assert sorted((r.epoch, r.mttr_s) for r in view.recoveries) == [(2, None), (3, 0.25)]
    assert view.owner_uid is None and view.records == 7
    # The node was seen at the first read; a later read without it remembers when.
    kv.delete(protocol.key(JOB, "nodes", "demo-node-0"), T)
    assert store.read(JOB).last_seen == {"demo-node-0": 100.0}


def test_claim_stamps_the_uid_and_reset_clears_the_prefix_first() -> None:
    kv = MemoryKV()
    store = AgentStore(kv, T)
    store.claim(ClaimPrefix(JOB, "uid-1"))
    put(kv, "progress", "n", protocol.ProgressRecord("n", 1, 1, 1))
    view = store.read(JOB)
    assert view.owner_uid == "uid-1" and view.records == 1
    store.claim(ClaimPrefix(JOB, "uid-2", reset=True))
    view = store.read(JOB)
    assert view.owner_uid == "uid-2" and view.records == 0 and not view.progress


def test_forget_deletes_every_key_of_the_job_only() -> None:
    kv = MemoryKV()
    store = AgentStore(kv, T)
    store.claim(ClaimPrefix(JOB, "uid-1"))
    put(kv, "progress", "n", protocol.ProgressRecord("n", 1, 1, 1))
    kv.put("/keepstep/jobs/ns.demo2/epoch", b"{}", T)
    assert store.forget(JOB) == 2
    assert kv.get_prefix(protocol.job_prefix(JOB), T) == []
    assert kv.get("/keepstep/jobs/ns.demo2/epoch", T) is not None
