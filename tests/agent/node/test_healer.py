"""The healer's answers to racing and waiting workers: one epoch per decision, and every
wait within its bound, on the in-memory KV with real agents and real links.

- Two agents handling the failure of the same epoch at once agree exactly one next epoch,
  and both answer their workers with it.
- A member's wait for the agreed epoch holds no lock: two members of a node failing at
  once each get their answer within the epoch bound (one used to wait for the other).
- A worker that no epoch admits gets AdmissionTimeout within the admission bound.
- A worker whose agent never answers gets AgentUnresponsive within its bound.
- An epoch whose members lack sharded state waits for a worker from outside it and admits
  it, with the same timeouts; with none to admit, the job stops within the bound.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.node import healer, probe
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.link_server import LinkServer
from keepstep.agent.node.view import Change, Observed
from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.link import AnswerBounds, Connection, socket_address
from keepstep.agent.protocol.messages import (
    AdmissionTimeout,
    AgentError,
    AgentUnresponsive,
    Excluded,
    Failure,
    Hello,
    Initial,
    JobCannotContinue,
    MembershipReply,
    Message,
    Ok,
    PendingPush,
    Reply,
    error_reply,
)
from keepstep.agent.worker import stores
from keepstep.agent.worker.controller import AgentController
from keepstep.agent.worker.link_client import LinkClient
from keepstep.elastic.control import Fallback
from keepstep.elastic.errors import PeerLost

T = 10.0  # generous for a loaded machine; the bounds under test are far shorter


def job_name(tag: str) -> str:
    return f"{tag}-{os.getpid()}-{time.monotonic_ns()}"


def link(job: str, node: str) -> LinkClient:
    return LinkClient(socket_address(job, node), lambda message: None, T)


def token_of(agent: NodeAgent, job: str) -> str:
    """The secret key prefix of the job's current epoch (a fresh one in each epoch)."""
    stored = agent.kv.get(protocol.key(job, "epoch"), T)
    assert stored is not None
    token = protocol.decode(protocol.EpochRecord, stored.value).token
    assert len(token) == 32, "128 random bits, hex"
    return token


def admitted(clients: dict[str, LinkClient]) -> dict[str, Reply]:
    """Each worker says hello, then all wait for their first epoch together."""
    for member, client in clients.items():
        assert client.request(Hello(member), T) == Ok()
    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {m: pool.submit(c.request, Initial(m), T) for m, c in clients.items()}
        return {m: f.result() for m, f in futures.items()}


def test_two_agents_failing_at_once_agree_one_epoch_and_both_answer(
    agents: Callable[..., NodeAgent], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = job_name("race")
    n0, n1 = agents(job, "n0", expected_nodes=2), agents(job, "n1", expected_nodes=2)
    clients = {"n0/0": link(job, "n0"), "n1/0": link(job, "n1")}
    try:
        first = admitted(clients)
        both = ("n0/0", "n1/0")
        token0 = token_of(n0, job)
        epoch0 = MembershipReply(0, both, n0.store_host.address, token=token0)
        assert first == {"n0/0": epoch0, "n1/0": epoch0}
        # Both agents observe epoch 0 before either writes: hold each at its probes until
        # the other has got there too, so that both propose and the CAS decides.
        probing = threading.Barrier(2, timeout=T)

        def probe_all(*args: Any) -> Any:
            probing.wait()
            return probe.probe_all(*args)

        monkeypatch.setattr(healer, "probe_all", probe_all)
        with ThreadPoolExecutor(2) as pool:
            futures = {
                m: pool.submit(c.request, Failure(m, 0, 5, "peer lost"), T)
                for m, c in clients.items()
            }
            answers = {m: f.result() for m, f in futures.items()}
    finally:
        for client in clients.values():
            client.close()
    # Both members still answer, so the epoch lost nothing: a false alarm, whose next epoch
    # waits twice as long before it takes a silent store or collective for a loss.
    token1 = token_of(n1, job)
    assert token1 != token0
    expected = MembershipReply(1, both, n0.store_host.address, timeout_scale=2.0, token=token1)
    assert answers == {"n0/0": expected, "n1/0": expected}
    events = read_events(tmp_path)
    proposed = [e["node"] for e in events if e["kind"] == "fault-detected"]
    assert sorted(proposed) == ["n0", "n1"]  # both decided ...
    agreed = [e for e in events if e["kind"] == "epoch-agreed" and e["epoch"] == 1]
    assert len(agreed) == 1, agreed  # ... one write won
    assert agreed[0]["members"] == list(both) and agreed[0]["step"] == 5
    stored = n1.kv.get(protocol.key(job, "epoch"), T)
    assert stored is not None and protocol.decode(protocol.EpochRecord, stored.value).epoch == 1


def test_members_waiting_for_the_epoch_each_get_their_answer_within_the_bound(
    agents: Callable[..., NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = job_name("bound")
    bound = 2.0
    node = agents(job, "n0", nproc=2, epoch_timeout=bound)
    clients = {"n0/0": link(job, "n0"), "n0/1": link(job, "n0")}
    try:
        admitted(clients)
        # From here on the agent's view never learns of a new epoch (a watch that stalls):
        # the epoch agreed after the failure is written but never seen.
        monkeypatch.setattr(node.view, "apply", lambda event: Change())
        t0 = time.monotonic()

        def fail(member: str) -> tuple[Exception | None, float]:
            try:
                clients[member].request(Failure(member, 0, 3, "peer lost"), T)
            except Exception as error:
                return error, time.monotonic() - t0
            return None, time.monotonic() - t0

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(fail, clients))
    finally:
        for client in clients.values():
            client.close()
    for error, took in results:
        assert isinstance(error, AgentError) and "EpochTimeout" in str(error), error
        # Each within its own bound; the second used to wait for the first's to end.
        assert bound <= took < 1.75 * bound, results


def test_a_worker_no_epoch_admits_gets_admission_timeout_within_the_bound(
    agents: Callable[..., NodeAgent],
) -> None:
    job = job_name("admit")
    node = agents(job, "n0", expected_nodes=2, admission_timeout=0.5)  # n1 never comes
    client = link(job, "n0")
    try:
        assert client.request(Hello("n0/0"), T) == Ok()
        t0 = time.monotonic()
        with pytest.raises(AdmissionTimeout, match=r"n0/0 was not admitted within 0\.5 s"):
            client.request(Initial("n0/0"), T)
        assert time.monotonic() - t0 < 0.5 + 2.0
    finally:
        client.close()
    # It no longer waits: nobody must admit it at the next boundary.
    assert node.kv.get(protocol.key(job, "pending", "n0/0"), T) is None


class FakeAgent:
    """An agent's link with scripted answers; None from `answer` means it never answers."""

    def __init__(self, answer: Callable[[Connection, Message], Reply | None]) -> None:
        self.address = socket_address(job_name("fake"), "n0")
        self.release = threading.Event()
        self.answer = answer
        self.server = LinkServer(self.address, self._handle)

    def _handle(self, conn: Connection, message: Message) -> Reply | None:
        if isinstance(message, Hello):
            conn.send(PendingPush(True))
            return Ok()
        reply = self.answer(conn, message)
        if reply is None:
            self.release.wait(T)  # wedged
        return reply

    def close(self) -> None:
        self.release.set()
        self.server.close()


def test_a_worker_whose_agent_never_answers_gets_agent_unresponsive_within_the_bound() -> None:
    agent = FakeAgent(lambda conn, message: None)
    bounds = AnswerBounds(reply=T, decision=0.3, admission=0.6)
    controller = AgentController(agent.address, "n0/0", bounds=bounds)
    missing = PeerLost(0, "no live copy", missing_state=True)
    try:
        calls: list[tuple[Callable[[], object], float]] = [
            (lambda: controller.initial(timeout=60.0), bounds.admission),
            (lambda: controller.poll(7, announced=True), bounds.decision),
            (lambda: controller.on_failure(0, 7, PeerLost(0, "lost"), 60.0), bounds.decision),
            # Missing state: the agent waits for a worker to admit, as long as admission.
            (lambda: controller.on_failure(0, 7, missing, 60.0), bounds.admission),
        ]
        for call, bound in calls:
            t0 = time.monotonic()
            with pytest.raises(AgentUnresponsive, match="did not answer"):
                call()
            assert bound <= time.monotonic() - t0 < bound + 1.0
    finally:
        controller.close()
        agent.close()


def test_an_epoch_missing_sharded_state_waits_for_a_worker_from_outside_it_and_admits_it(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    job = job_name("missing")
    agents(job, "n0", expected_nodes=2), agents(job, "n1", expected_nodes=2)
    clients = {"n0/0": link(job, "n0"), "n1/0": link(job, "n1")}
    try:
        admitted(clients)
        # n2's agent is up and its worker outside epoch 0, as a restarting worker is whose
        # node kept its snapshot: it may hold the missing state.
        agents(job, "n2", expected_nodes=2)
        with ThreadPoolExecutor(3) as pool:
            futures = {
                m: pool.submit(c.request, Failure(m, 0, 5, "no live copy", True), 3 * T)
                for m, c in clients.items()
            }
            # Both members answer the probes, so a failure would be decided in ms; this
            # one waits for the worker from outside the epoch to ask to be admitted.
            time.sleep(1.5)
            assert not any(f.done() for f in futures.values())
            clients["n2/0"] = link(job, "n2")
            assert clients["n2/0"].request(Hello("n2/0"), T) == Ok()
            futures["n2/0"] = pool.submit(clients["n2/0"].request, Initial("n2/0"), T)
            answers = {m: f.result() for m, f in futures.items()}
    finally:
        for client in clients.values():
            client.close()
    members = ("n0/0", "n1/0", "n2/0")
    for answer in answers.values():  # one epoch for all, its timeouts not raised
        assert isinstance(answer, MembershipReply), answer
        assert (answer.epoch, answer.members, answer.timeout_scale) == (1, members, 1.0)
    events = read_events(tmp_path)
    detected = [e for e in events if e["kind"] == "fault-detected"]
    assert detected and {e["cause"] for e in detected} == {"missing-state"}
    agreed = [e for e in events if e["kind"] == "epoch-agreed" and e["epoch"] == 1]
    assert len(agreed) == 1, agreed
    assert "admit n2/0 for the missing sharded state" in agreed[0]["reason"]


def test_an_epoch_missing_sharded_state_with_no_worker_to_admit_stops_within_the_bound(
    agents: Callable[..., NodeAgent],
) -> None:
    job = job_name("missing-bound")
    agents(job, "n0", expected_nodes=1, missing_state_wait=0.5)
    client = link(job, "n0")
    try:
        admitted({"n0/0": client})
        # n1's worker, outside the epoch, might hold the state, but never asks to join.
        agents(job, "n1", expected_nodes=1)
        t0 = time.monotonic()
        with pytest.raises(
            JobCannotContinue,
            match=r"lacks sharded optimizer state \(no live copy\): no worker that could "
            r"hold it was ready within 0.5 s, and it writes no durable checkpoint",
        ):
            client.request(Failure("n0/0", 0, 5, "no live copy", True), T)
        assert 0.5 <= time.monotonic() - t0 < 0.5 + 2.0
    finally:
        client.close()


def test_an_epoch_missing_sharded_state_whose_holders_are_all_gone_stops_at_once(
    agents: Callable[..., NodeAgent],
) -> None:
    # Every live node's workers are members already: nobody can bring the state back, so
    # waiting the bound (an hour here) would only delay the verdict.
    job = job_name("missing-gone")
    agents(job, "n0", expected_nodes=1, missing_state_wait=3600.0)
    client = link(job, "n0")
    try:
        admitted({"n0/0": client})
        t0 = time.monotonic()
        with pytest.raises(JobCannotContinue, match="every worker that could hold it is gone"):
            client.request(Failure("n0/0", 0, 5, "no live copy", True), T)
        assert time.monotonic() - t0 < 2.0
    finally:
        client.close()


def test_a_node_whose_own_lease_expired_counts_itself_and_decides_alone(
    agents: Callable[..., NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen in the 1,000-fault campaign: of a two-node epoch, n0 drained while n1 was cut
    # off, long enough for n1's lease to expire. Back, n1 saw no live node of the epoch,
    # itself included, so it was never a majority: it waited for a decision nobody was
    # left to make, and its worker restarted until the agent gave up.
    job = job_name("own-lease")
    agents(job, "n0", expected_nodes=2)
    n1 = agents(job, "n1", expected_nodes=2)
    clients = {"n0/0": link(job, "n0"), "n1/0": link(job, "n1")}
    try:
        admitted(clients)
        real = n1.view.observe

        def neither() -> Observed:  # n0 has left; n1's own lease has expired
            seen = real()
            return dataclasses.replace(seen, nodes={})

        monkeypatch.setattr(n1.view, "observe", neither)
        answer = clients["n1/0"].request(Failure("n1/0", 0, 5, "peer lost"), T)
    finally:
        for client in clients.values():
            client.close()
    assert isinstance(answer, MembershipReply), answer
    assert (answer.epoch, answer.members, answer.store) == (1, ("n1/0",), n1.store_host.address)


def test_an_excluded_worker_asks_to_be_admitted_again() -> None:
    asked: list[Message] = []

    def answer(conn: Connection, message: Message) -> Reply | None:
        asked.append(message)
        if isinstance(message, Failure):
            return Excluded(2)
        return MembershipReply(3, ("n0/0", "n1/0"), "127.0.0.1:1")

    agent = FakeAgent(answer)
    controller = AgentController(agent.address, "n0/0", bounds=AnswerBounds(reply=T))
    try:
        membership = controller.on_failure(1, 9, PeerLost(1, "lost"), 60.0)
        assert (membership.epoch, membership.members) == (3, ("n0/0", "n1/0"))
        assert asked == [Failure("n0/0", 1, 9, "lost"), Initial("n0/0")]
        assert controller.change_pending()  # the flag the agent pushed at hello
    finally:
        controller.close()
        agent.close()


def test_a_worker_whose_failure_ends_the_job_releases_its_store_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its group build may still sit in a store call; left there, the thread would wake in
    # the exiting interpreter and end the process with SIGABRT instead of the error.
    released: list[set[str]] = []
    monkeypatch.setattr(
        stores, "release_connections", lambda addresses, timeout: released.append(set(addresses))
    )

    def answer(conn: Connection, message: Message) -> Reply | None:
        if isinstance(message, Initial):
            return MembershipReply(1, ("n0/0", "n1/0"), "127.0.0.1:7001")
        return error_reply(JobCannotContinue("too few nodes left"))

    agent = FakeAgent(answer)
    controller = AgentController(agent.address, "n0/0", bounds=AnswerBounds(reply=T))
    try:
        controller.initial(timeout=60.0)
        assert released == []
        with pytest.raises(JobCannotContinue, match="too few nodes left"):
            controller.on_failure(1, 9, PeerLost(1, "lost"), 60.0)
        assert released == [{"127.0.0.1:7001"}]
    finally:
        controller.close()
        agent.close()


def test_a_node_too_slow_for_the_probe_is_probed_again_before_it_is_blamed(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    # n1's agent answers probes late (a loaded machine), but its lease is alive: it is
    # probed again for as long as its lease lasts, and nothing is lost. (Heartbeats off:
    # with them, an answer later than their bound makes a node hung, as the next test shows.)
    job = job_name("slow-probe")
    slow = {"probe_timeout": 0.3, "lease_ttl": 1.0, "heartbeat_timeout": 0}
    n0 = agents(job, "n0", expected_nodes=2, **slow)
    n1 = agents(job, "n1", expected_nodes=2, **slow)
    clients = {"n0/0": link(job, "n0"), "n1/0": link(job, "n1")}
    try:
        admitted(clients)
        status = n1.probe_server.status

        def late() -> dict[str, Any]:
            time.sleep(0.6)
            return status()

        n1.probe_server.status = late
        answer = clients["n0/0"].request(Failure("n0/0", 0, 4, "peer lost"), T)
    finally:
        for client in clients.values():
            client.close()
    token = token_of(n0, job)
    assert answer == MembershipReply(
        1, ("n0/0", "n1/0"), n0.store_host.address, timeout_scale=2.0, token=token
    )
    agreed = [e for e in read_events(tmp_path) if e["kind"] == "epoch-agreed" and e["epoch"] == 1]
    assert agreed[0]["reason"].startswith("lost nothing; timeouts raised to 2x"), agreed
    assert agreed[0]["timeout_scale"] == 2.0


def test_a_node_that_stops_answering_is_found_by_its_neighbours_heartbeats(
    agents: Callable[..., NodeAgent], tmp_path: Path
) -> None:
    # n1's agent stops answering (its probe thread blocks, as in a SIGSTOP) while its lease
    # stays alive: n0's heartbeats find it and abort the epoch within about their bound,
    # long before any collective or lease would, and the next epoch is agreed without it.
    job = job_name("heartbeat")
    n0 = agents(job, "n0", expected_nodes=2, heartbeat_timeout=0.5, lease_ttl=5.0)
    n1 = agents(job, "n1", expected_nodes=2, heartbeat_timeout=0.5, lease_ttl=5.0)
    clients = {"n0/0": link(job, "n0"), "n1/0": link(job, "n1")}
    resume = threading.Event()
    try:
        admitted(clients)

        def never() -> dict[str, Any]:
            resume.wait(30)
            return {}

        n1.probe_server.status = never
        deadline = time.monotonic() + T
        detected: list[dict[str, Any]] = []
        while not detected and time.monotonic() < deadline:
            time.sleep(0.05)
            detected = [
                e
                for e in read_events(tmp_path)
                if e["kind"] == "fault-detected" and e.get("cause") == "heartbeat-missed"
            ]
        assert detected, "n0 never reported n1's missed heartbeats"
        assert detected[0]["node"] == "n1" and detected[0]["epoch"] == 0
        assert "missed its heartbeats" in detected[0]["reason"]
        # The worker on n0 sees its collective fail and asks for the next epoch.
        answer = clients["n0/0"].request(Failure("n0/0", 0, 4, "peer lost"), T)
        assert isinstance(answer, MembershipReply) and answer.members == ("n0/0",), answer
        assert n0.heartbeat is not None and n0.heartbeat.silent_nodes() == {"n1"}
    finally:
        resume.set()
        for client in clients.values():
            client.close()


def test_a_fallback_epoch_reaches_the_library_with_its_checkpoint() -> None:
    def answer(conn: Connection, message: Message) -> Reply | None:
        if isinstance(message, Failure) and message.missing_state:
            return MembershipReply(2, ("n0/0",), "127.0.0.1:1", 1.0, "", 8, "/dev/shm/ckpt")
        return MembershipReply(1, ("n0/0",), "127.0.0.1:1")

    agent = FakeAgent(answer)
    controller = AgentController(agent.address, "n0/0", bounds=AnswerBounds(reply=T))
    try:
        plain = controller.on_failure(0, 9, PeerLost(0, "lost"), 60.0)
        assert plain.fallback is None
        missing = PeerLost(1, "no live copy", missing_state=True)
        membership = controller.on_failure(1, 9, missing, 60.0)
        assert membership.fallback == Fallback(8, "/dev/shm/ckpt")
    finally:
        controller.close()
        agent.close()
