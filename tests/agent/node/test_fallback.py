"""Falling back to the durable checkpoint when a double fault lost sharded state.

Agents on one in-memory KV (each its own client), checkpoints in a real directory through
the real writer and reader; the test speaks for the workers over their links.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from keepstep.agent import protocol
from keepstep.agent.durable.reader import checkpoint_at
from keepstep.agent.durable.writer import CheckpointWriter
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.node.durable import resume_file
from keepstep.agent.node.fallback import Fallback
from keepstep.agent.protocol import EpochRecord, NodeRecord
from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.link import socket_address
from keepstep.agent.protocol.messages import (
    Failure,
    Hello,
    Initial,
    JobCannotContinue,
    MembershipReply,
    Ok,
)
from keepstep.agent.worker.link_client import LinkClient
from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.train_state import capture

T = 10.0


def snapshot_blob(step: int) -> bytes:
    """An exported snapshot of a small trained model at ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    state = capture(step, model, opt)
    store = SnapshotStore(MemoryBuffer(), background=False)
    store.commit(step, state.tensors, state.meta)
    return store.export(step)


def write_checkpoints(url: str, steps: list[int]) -> dict[int, bytes]:
    blobs = {step: snapshot_blob(step) for step in steps}
    writer = CheckpointWriter(url, 1)
    for step in steps:
        writer.submit(step, blobs[step])
        writer.flush(T)
    writer.close(T)
    return blobs


def job_name(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{time.monotonic_ns()}"


def admitted_clients(job: str, nodes: list[str]) -> dict[str, LinkClient]:
    clients = {f"{n}/0": LinkClient(socket_address(job, n), lambda m: None, T) for n in nodes}
    for member, client in clients.items():
        assert client.request(Hello(member), T) == Ok()
    with ThreadPoolExecutor(len(clients)) as pool:
        for f in [pool.submit(c.request, Initial(m), T) for m, c in clients.items()]:
            assert isinstance(f.result(), MembershipReply)
    return clients


def test_state_lost_with_every_holder_resumes_every_member_from_the_newest_checkpoint(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    url = (tmp_path / "ckpt").as_uri()
    blobs = write_checkpoints(url, [4, 8])
    job = job_name("fallback")
    for node in ("n0", "n1"):
        agents(job, node, expected_nodes=2, checkpoint_url=url, checkpoint_every=4)
    clients = admitted_clients(job, ["n0", "n1"])
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            futures = {
                m: pool.submit(c.request, Failure(m, 0, 11, "no live copy", True), T)
                for m, c in clients.items()
            }
            answers = {m: f.result() for m, f in futures.items()}
        took = time.monotonic() - t0
    finally:
        for client in clients.values():
            client.close()
    assert took < 3.0  # every live worker is a member: nothing to wait for
    paths = set()
    for answer in answers.values():
        assert isinstance(answer, MembershipReply), answer
        assert (answer.epoch, answer.members) == (1, ("n0/0", "n1/0"))
        assert answer.checkpoint_step == 8
        paths.add(answer.checkpoint)
    assert len(paths) == 2  # each agent wrote its own, in its run directory
    for path in map(Path, paths):
        assert path.parent == tmp_path and path.read_bytes() == blobs[8]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    agreed = [e for e in read_events(tmp_path) if e["kind"] == "epoch-agreed" and e["epoch"] == 1]
    assert len(agreed) == 1 and agreed[0]["checkpoint_step"] == 8, agreed
    assert "every worker that could hold it is gone" in agreed[0]["reason"]
    assert "all resume from the durable checkpoint of step 8" in agreed[0]["reason"]


def test_no_checkpoint_written_yet_stops_the_job_naming_the_url(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    url = (tmp_path / "empty").as_uri()
    job = job_name("fallback-none")
    agents(job, "n0", expected_nodes=1, checkpoint_url=url, checkpoint_every=4)
    [client] = admitted_clients(job, ["n0"]).values()
    says = re.escape(f"no durable checkpoint at {url} was completed yet")
    try:
        with pytest.raises(JobCannotContinue, match=says):
            client.request(Failure("n0/0", 0, 3, "no live copy", True), T)
    finally:
        client.close()


def test_the_file_is_read_once_per_epoch_and_an_older_one_removed(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    blobs = write_checkpoints(url, [4, 8])
    run, shm = tmp_path / "run", tmp_path / "shm"
    run.mkdir(), shm.mkdir()
    cfg = AgentConfig(
        job="j", node="n0", etcd="", script="x", run_dir=run, snapshot_dir=shm, checkpoint_url=url
    )
    fallback = Fallback(cfg)
    first = fallback.file_for(EpochRecord(3, ["n0/0"], checkpoint_step=4))
    assert first.read_bytes() == blobs[4]
    assert first.parent == run, "on disk: shared memory is sized for the snapshots"
    first.write_bytes(b"read once")  # a second worker's ask is answered from the file
    assert fallback.file_for(EpochRecord(3, ["n0/0"], checkpoint_step=4)) == first
    assert first.read_bytes() == b"read once"
    second = fallback.file_for(EpochRecord(5, ["n0/0"], checkpoint_step=8))
    assert second.read_bytes() == blobs[8] and not first.exists()
    with pytest.raises(JobCannotContinue, match=r"checkpoint of step 6 .* cannot be read"):
        fallback.file_for(EpochRecord(7, ["n0/0"], checkpoint_step=6))
    fallback.close()
    assert not second.exists()


def test_checkpoint_at_reads_a_published_step_and_refuses_another(tmp_path: Path) -> None:
    url = (tmp_path / "ckpt").as_uri()
    blobs = write_checkpoints(url, [4, 8])
    info, blob = checkpoint_at(url, 4, T)
    assert (info.step, blob) == (4, blobs[4])  # not the newest: the step asked for
    with pytest.raises(SnapshotMissing, match="no published checkpoint of step 5"):
        checkpoint_at(url, 5, T)


def test_a_node_whose_agent_refuses_the_probe_is_not_waited_for(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    # n2's worker is outside the epoch, and n2's record is still in the store (its lease
    # has not expired), but its agent is gone (its port refuses connections): its
    # snapshots went with it, so nothing is waited for.
    url = (tmp_path / "ckpt").as_uri()
    write_checkpoints(url, [4])
    job = job_name("fallback-dead")
    settings = {"checkpoint_url": url, "checkpoint_every": 4, "missing_state_wait": 3600.0}
    n0 = agents(job, "n0", expected_nodes=1, **settings)
    [client] = admitted_clients(job, ["n0"]).values()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once it is closed
    dead = NodeRecord("n2", "127.0.0.1", port, pid=1, workers={"n2/0": 2})
    n0.kv.put(protocol.key(job, "nodes", "n2"), protocol.encode(dead), T)
    try:
        t0 = time.monotonic()
        answer = client.request(Failure("n0/0", 0, 6, "no live copy", True), T)
        assert time.monotonic() - t0 < 3.0
    finally:
        client.close()
    assert isinstance(answer, MembershipReply) and answer.checkpoint_step == 4, answer


def test_a_resumed_node_writes_the_checkpoint_once_for_its_workers(tmp_path: Path) -> None:
    blob = snapshot_blob(12)
    path, step = resume_file(tmp_path, "n3", blob)
    assert (path, step) == (tmp_path / "resume-n3-step-12.ckpt", 12)
    assert path.read_bytes() == blob and stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(SnapshotCorrupt, match=r"the checkpoint to resume from: .*checksum"):
        resume_file(tmp_path, "n3", blob[:-1] + bytes([blob[-1] ^ 0xFF]))
