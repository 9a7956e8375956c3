"""Who can steer an epoch through the process-group store an agent hosts.

- The store listens on the node's address only, not on every interface.
- An epoch's members hear only aborts written under the epoch's secret prefix (its
  token): one written without it, or under a guessed one, steers nothing. The agent's
  own abort carries the token and reaches the members at once (pushed, not polled).
- An agent that ends an epoch writes the abort under that epoch's token.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv.memory import MemoryKV
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.node.stores import StoreClients, StoreHost
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.worker import stores
from keepstep.elastic.comm import Communicator, abort_epoch, abort_key

T = 5.0
TOKEN = "5e" * 16


def test_the_store_listens_on_the_node_address_only() -> None:
    host = StoreHost("127.0.0.1")
    host.serve()
    # All of 127/8 is loopback: a store on every interface would answer on 127.0.0.2 too.
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", host.port), timeout=T).close()
    client = stores.connect(host.address, T)
    client.set("k", "v")
    assert client.get("k") == b"v"


def test_a_client_that_comes_before_the_server_waits_for_it() -> None:
    """The agent binds the store's socket, starts its workers, then serves (torch's
    import comes in between): a peer that connects meanwhile is answered once it serves."""
    host = StoreHost("127.0.0.1")
    got: list[bytes] = []

    def early() -> None:
        client = stores.connect(host.address, T)
        client.set("early", "yes")
        got.append(client.get("early"))

    thread = threading.Thread(target=early)
    thread.start()
    time.sleep(0.3)
    assert not got
    host.serve()
    thread.join(T)
    assert got == [b"yes"]


def test_an_epoch_hears_only_aborts_under_its_token() -> None:
    host = StoreHost("127.0.0.1")
    host.serve()
    raw = stores.connect(host.address, T)
    members = stores.for_epoch(stores.connect(host.address, T), TOKEN)
    comm = Communicator.create(members, 0, ["solo"], "solo")
    try:
        # What a process that reached the port, but not the job's records, can write.
        abort_epoch(raw, 0, "forged", 1)
        abort_epoch(stores.for_epoch(raw, "0" * 32), 0, "guessed", 1)
        raw.set("keepstep/epoch-0/0", "forged rendezvous")
        assert not comm.aborted(wait=True)
        t0 = time.monotonic()
        StoreClients(timeout=T).abort(host.address, 0, 1, "node n1 lost its lease", TOKEN)
        while not comm.aborted(wait=False) and time.monotonic() - t0 < T:
            time.sleep(0.001)
        took = time.monotonic() - t0
        assert comm.aborted(wait=False)
        assert took < 1.0, took  # pushed to the watch, as without a prefix
        assert raw.get(f"{TOKEN}/{abort_key(0)}") == b"node n1 lost its lease"
    finally:
        comm.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[NodeAgent, MemoryKV]]:
    kv = MemoryKV()
    cfg = AgentConfig(
        job=f"stores-{os.getpid()}-{time.monotonic_ns()}",
        node="n0",
        etcd="",
        script="",
        command=("sleep", "60"),  # workers that never say hello: never ready
        nproc=1,
        run_dir=tmp_path,
        snapshot_dir=tmp_path,
    )
    node = NodeAgent(cfg, kv)
    node.start()
    try:
        yield node, kv
    finally:
        node.close()


def test_an_agent_ends_an_epoch_under_its_token(agent: tuple[NodeAgent, MemoryKV]) -> None:
    node, kv = agent
    address = node.store_host.address
    raw = stores.connect(address, T)
    # An epoch naming n0/0, which is not ready here: the agent ends it at once.
    record = EpochRecord(1, ["n0/0", "n1/0"], store=address, token=TOKEN)
    kv.put(protocol.key(node.cfg.job, "epoch"), protocol.encode(record), T)
    key = f"{TOKEN}/{abort_key(1)}"
    deadline = time.monotonic() + T
    while not raw.check([key]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert raw.get(key).decode() == "epoch 1 names n0/0, not running on n0"
    assert not raw.check([abort_key(1)])
