"""A boundary's decision survives etcd not answering for a while (its leader lost and a
new one being elected): the agent asks again instead of telling its worker to give up,
and a decision whose creator never heard it was created still gets its epoch written."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv import KVTimeout, KVUnavailable, Lease
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.link import socket_address
from keepstep.agent.protocol.messages import Boundary, Hello, Initial, MembershipReply, Ok
from keepstep.agent.worker.link_client import LinkClient

T = 10.0


class ElectingKV:
    """The agent's KV, whose first `create` gets no answer and whose second is applied but
    its answer lost (KVTimeout, then KVUnavailable: etcd answers both while it elects a
    leader)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.creates = inner, 0

    def create(self, key: str, value: bytes, timeout: float, lease: Lease | None = None) -> bool:
        self.creates += 1
        if self.creates == 1:
            raise KVTimeout(f"create {key!r}: etcd did not answer within {timeout} s")
        created = self.inner.create(key, value, timeout, lease)
        if self.creates == 2:
            assert created
            raise KVUnavailable(f"create {key!r}: etcd answered UNAVAILABLE: request timed out")
        return bool(created)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_drain_at_a_boundary_is_agreed_through_an_etcd_election(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    job = f"electing-{os.getpid()}-{time.monotonic_ns()}"
    n0, n1 = agents(job, "n0", expected_nodes=2), agents(job, "n1", expected_nodes=2)
    clients = {
        m: LinkClient(socket_address(job, m[:2]), lambda _: None, T) for m in ("n0/0", "n1/0")
    }
    try:
        for member, client in clients.items():
            assert client.request(Hello(member), T) == Ok()
        with ThreadPoolExecutor(2) as pool:  # the first epoch waits for both nodes
            first = [pool.submit(c.request, Initial(m), T) for m, c in clients.items()]
            assert all(isinstance(f.result(), MembershipReply) for f in first)
        n1.drain()
        deadline = time.monotonic() + T
        while "n1" not in n0.view.observe().leaving:
            assert time.monotonic() < deadline, "n0 never saw n1 leaving"
            time.sleep(0.02)
        electing = ElectingKV(n0.healer.kv)
        n0.healer.kv = electing
        answer = clients["n0/0"].request(Boundary("n0/0", 5), T)
    finally:
        for client in clients.values():
            client.close()
    assert isinstance(answer, MembershipReply), answer
    assert (answer.epoch, answer.members) == (1, ("n0/0",))
    assert electing.creates == 3  # no answer, a lost answer, then "exists"
    stored = n0.kv.get(protocol.key(job, "epoch"), T)
    assert stored is not None
    assert protocol.decode(protocol.EpochRecord, stored.value).members == ["n0/0"]
    agreed = [e for e in read_events(tmp_path) if e["kind"] == "epoch-agreed" and e["epoch"] == 1]
    assert len(agreed) == 1 and agreed[0]["reason"] == "drain n1/0", agreed


def _epoch(n: int, start_step: int) -> protocol.EpochRecord:
    return protocol.EpochRecord(
        n, ["n9/0"], f"epoch {n}", start_step, time.time(), store="127.0.0.1:9", token="ab" * 16
    )


def test_an_epoch_superseded_before_its_first_step_is_ended_for_its_members(
    agents: Callable[..., NodeAgent],
) -> None:
    """A drain and a node back at one boundary: one member told epoch 17 while the others
    went on to 18 waited out 17's 30 s rendezvous. The agents now end 17 when 18 replaces
    it at the same step; an epoch that trained a step is left to the fault paths."""
    job = f"superseded-{os.getpid()}-{time.monotonic_ns()}"
    n0 = agents(job, "n0", expected_nodes=2)
    ended: list[tuple[int, str]] = []
    n0.stores.end = lambda epoch, reason: ended.append((epoch.epoch, reason))  # type: ignore[method-assign]
    for record in (_epoch(16, 270), _epoch(17, 272), _epoch(18, 272), _epoch(19, 280)):
        n0.kv.put(protocol.key(job, "epoch"), protocol.encode(record), T)
    deadline = time.monotonic() + T
    while (n0.view.current is None or n0.view.current.epoch < 19) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert n0.view.current is not None and n0.view.current.epoch == 19
    assert ended == [(17, "superseded by epoch 18")]


def test_superseded_unstarted_needs_the_same_start_step_and_a_store() -> None:
    from keepstep.agent.node.agreement import superseded_unstarted

    assert superseded_unstarted(_epoch(1, 5), _epoch(2, 5))
    assert not superseded_unstarted(_epoch(1, 5), _epoch(2, 6))
    assert not superseded_unstarted(_epoch(2, 5), _epoch(2, 5))
    storeless = protocol.EpochRecord(1, ["n9/0"], "x", 5, 0.0)
    assert not superseded_unstarted(storeless, _epoch(2, 5))


def test_a_worker_is_admitted_through_an_etcd_election(
    agents: Callable[..., NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted worker announcing itself while etcd elects a leader used to get the
    KVTimeout and exit; its agent gave up after three such restarts in a row."""
    job = f"admit-electing-{os.getpid()}-{time.monotonic_ns()}"
    n0 = agents(job, "n0", expected_nodes=1)
    registration = n0.healer._registration
    put, calls = registration.put, []

    def electing_put(k: str, value: bytes) -> None:
        calls.append(k)
        if len(calls) == 1:
            raise KVTimeout(f"put {k!r}: etcd did not answer within 5.0 s")
        put(k, value)

    monkeypatch.setattr(registration, "put", electing_put)
    client = LinkClient(socket_address(job, "n0"), lambda _: None, T)
    try:
        assert client.request(Hello("n0/0"), T) == Ok()
        answer = client.request(Initial("n0/0"), T)
    finally:
        client.close()
    assert isinstance(answer, MembershipReply) and answer.members == ("n0/0",), answer
    assert len(calls) == 2


class ElectingCasKV:
    """The agent's KV, whose first compare-and-set gets no answer and whose second is
    applied but its answer lost (etcd electing a leader: KVTimeout, then KVUnavailable);
    later ones answer."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.cas = inner, 0

    def compare_and_put(self, key: str, value: bytes, revision: int, timeout: float) -> bool:
        self.cas += 1
        if self.cas == 1:
            raise KVTimeout(f"compare-and-put {key!r}: etcd did not answer within {timeout} s")
        done = self.inner.compare_and_put(key, value, revision, timeout)
        if self.cas == 2:
            assert done
            raise KVUnavailable(f"compare-and-put {key!r}: etcd answered UNAVAILABLE: no leader")
        return bool(done)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_failures_epoch_is_agreed_through_an_etcd_election(
    agents: Callable[..., NodeAgent],
) -> None:
    """A failure's decision that met etcd electing a leader answered the worker with the
    KVTimeout, and the worker exited to restart from its snapshot (11 times in the
    campaign). The proposal is asked again; one that landed unanswered is read back."""
    job = f"failure-electing-{os.getpid()}-{time.monotonic_ns()}"
    n0 = agents(job, "n0", expected_nodes=1)
    client = LinkClient(socket_address(job, "n0"), lambda _: None, T)
    try:
        assert client.request(Hello("n0/0"), T) == Ok()
        assert isinstance(client.request(Initial("n0/0"), T), MembershipReply)
    finally:
        client.close()
    seen = n0.view.observe()
    assert seen.current is not None
    mine = replace(seen.current, epoch=1, reason="lost nothing", created_at=time.time())
    electing = ElectingCasKV(n0.healer.kv)
    n0.healer.kv = electing
    assert n0.healer._propose(mine, seen.revision)
    assert electing.cas == 3  # no answer, a lost answer, then "not at that revision"
    stored = n0.kv.get(protocol.key(job, "epoch"), T)
    assert stored is not None and protocol.decode(protocol.EpochRecord, stored.value) == mine
    # Another agent's proposal won: answered at once, nothing read back, not agreed here.
    theirs = replace(mine, epoch=2, created_at=time.time())
    n0.kv.put(protocol.key(job, "epoch"), protocol.encode(theirs), T)
    assert not n0.healer._propose(replace(theirs, reason="mine"), seen.revision)
