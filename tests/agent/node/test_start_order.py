"""How a node agent starts: its workers first, then what needs torch.

A worker takes seconds to import torch and build its model; so does the agent's own
import of torch (for the store it hosts). The agent starts its workers before that
import, so a new node (a join, a replacement pod) trains about that much sooner, and
holds a worker's request to be admitted until the node has registered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv import KVTimeout, KVUnavailable, Lease
from keepstep.agent.kv.memory import MemoryKV
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.protocol.link import socket_address
from keepstep.agent.protocol.messages import AdmissionTimeout, Hello, Initial, MembershipReply, Ok
from keepstep.agent.worker.link_client import LinkClient

T = 10.0


def config(tmp_path: Path, **kw: object) -> AgentConfig:
    return AgentConfig(
        job=f"start-{os.getpid()}-{time.monotonic_ns()}",
        node="n0",
        etcd="",
        script="",
        command=("sleep", "60"),  # the test speaks for the worker over its link
        run_dir=tmp_path,
        snapshot_dir=tmp_path,
        **kw,  # type: ignore[arg-type]
    )


def test_the_workers_start_before_the_agent_imports_torch(tmp_path: Path) -> None:
    probe = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from keepstep.agent.kv.memory import MemoryKV
        from keepstep.agent.node.agent import NodeAgent
        from keepstep.agent.node.config import AgentConfig

        cfg = AgentConfig(job="order", node="n0", etcd="", script="", command=("sleep", "60"),
                          nproc=2, run_dir=Path({str(tmp_path)!r}),
                          snapshot_dir=Path({str(tmp_path)!r}))
        agent = NodeAgent(cfg, MemoryKV())
        before = "torch" in sys.modules
        spawned = []
        start = agent.supervisor.start

        def spy(spec, spare):
            spawned.append("torch" in sys.modules)
            return start(spec, spare)

        agent.supervisor.start = spy
        agent.start()
        try:
            print(before, spawned, "torch" in sys.modules, agent.registration.wait_registered(0))
        finally:
            agent.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    # Built without torch; both workers started before torch was imported; once started,
    # the agent hosts its store (torch) and is registered.
    assert done.stdout.split("\n")[0] == "False [False, False] True True", done.stdout


def test_a_worker_is_admitted_only_once_its_node_registered(tmp_path: Path) -> None:
    cfg = config(tmp_path, nproc=1, expected_nodes=1)
    kv = MemoryKV()
    agent = NodeAgent(cfg, kv)
    client = LinkClient(socket_address(cfg.job, cfg.node), lambda message: None, T)
    answers: list[object] = []
    try:
        # The worker's link is up before the agent has started: it says hello and asks
        # to be admitted, as a worker whose imports beat the agent's would.
        assert client.request(Hello("n0/0"), T) == Ok()
        asking = threading.Thread(target=lambda: answers.append(client.request(Initial("n0/0"), T)))
        asking.start()
        time.sleep(0.3)
        pending = protocol.key(cfg.job, "pending", "n0/0")
        assert kv.get(pending, T) is None, "announced before the node had a lease"
        assert not answers
        agent.start()
        asking.join(T)
        assert len(answers) == 1 and isinstance(answers[0], MembershipReply), answers
        assert answers[0].members == ("n0/0",)
    finally:
        client.close()
        agent.close()


def test_a_node_that_never_registers_answers_admission_timeout(tmp_path: Path) -> None:
    agent = NodeAgent(config(tmp_path, nproc=1, admission_timeout=0.3), MemoryKV())
    try:
        with pytest.raises(AdmissionTimeout, match=r"n0/0 .* its node did not register"):
            agent.healer.admit("n0/0")
    finally:
        agent.close()


class UnansweredAtFirst:
    """The agent's KV, whose first `failures` reads of the job and lease grants get no
    answer (etcd electing a leader answers nothing, or UNAVAILABLE, for seconds)."""

    def __init__(self, inner: MemoryKV, failures: int = 1) -> None:
        self.inner, self.failures = inner, failures
        self.calls: list[str] = []

    def get_prefix(self, prefix: str, timeout: float) -> Any:
        self.calls.append("get_prefix")
        if self.calls.count("get_prefix") <= self.failures:
            raise KVUnavailable(f"get {prefix!r}: etcd answered UNAVAILABLE: no leader")
        return self.inner.get_prefix(prefix, timeout)

    def grant_lease(self, ttl: float, timeout: float) -> Lease:
        self.calls.append("grant_lease")
        if self.calls.count("grant_lease") <= self.failures:
            raise KVTimeout(f"grant lease of {ttl:g} s: etcd did not answer within {timeout} s")
        return self.inner.grant_lease(ttl, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_node_started_while_etcd_does_not_answer_asks_again(tmp_path: Path) -> None:
    """A node joining while etcd did not answer its lease grant for 5 s exited with the
    KVTimeout (the fourth 1,000-fault campaign, run 33): the job went on without it, but
    `keepstep run` then exited 1."""
    cfg = config(tmp_path, nproc=1)
    kv = UnansweredAtFirst(MemoryKV())
    agent = NodeAgent(cfg, kv)  # type: ignore[arg-type]  # a KVStore by delegation
    try:
        agent.start()
        assert agent.registration.wait_registered(0)
        record = kv.inner.get(protocol.key(cfg.job, "nodes", "n0"), T)
        assert record is not None and record.lease is not None
    finally:
        agent.close()
    assert kv.calls == ["get_prefix", "get_prefix", "grant_lease", "grant_lease"]


def test_a_node_whose_etcd_never_answers_gives_up_after_its_bound(tmp_path: Path) -> None:
    kv = UnansweredAtFirst(MemoryKV(), failures=10**6)
    agent = NodeAgent(config(tmp_path, nproc=1, op_timeout=0.2), kv)  # type: ignore[arg-type]
    began = time.monotonic()
    try:
        with pytest.raises(KVUnavailable, match="no leader"):
            agent.start()
    finally:
        agent.close()
    # Asked again for two op timeouts (0.4 s), a pause of 0.2 s between tries.
    assert 0.4 <= time.monotonic() - began < 5.0
    assert 2 <= kv.calls.count("get_prefix") <= 4
