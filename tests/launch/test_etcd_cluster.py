"""EtcdCluster and EtcdKV against a real three-member etcd: the cluster starts and stops
by PID, and a client keeps working (reads, writes, compare-and-set, lease keepalive,
watches without gaps or repeats) when one member is SIGKILLed, the leader or not."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from keepstep.agent.kv import KVError, WatchEvent
from keepstep.agent.kv.etcd import EtcdKV
from keepstep.agent.kv.etcd_channel import grpc_target, parse_endpoints
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_cluster import EtcdCluster, metrics, start_etcd
from keepstep.launch.etcd_server import EtcdServer

T = TypeVar("T")


@pytest.fixture
def cluster(etcd_binary: str, tmp_path: Path) -> Iterator[EtcdCluster]:
    with EtcdCluster.start(etcd_binary, tmp_path / "etcd") as started:
        yield started


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def until_it_works(call: Callable[[], T], within: float = 5.0) -> tuple[T, float]:
    """Repeat `call` while it raises KVError (an election under way); its result and how
    long the failures lasted."""
    start = time.monotonic()
    while True:
        try:
            return call(), time.monotonic() - start
        except KVError:
            if time.monotonic() - start > within:
                raise
            time.sleep(0.02)


class Recorder:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: WatchEvent) -> None:
        with self._lock:
            self.events.append(event)

    def wait_for(self, count: int, timeout: float) -> list[WatchEvent]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.events) >= count:
                    break
            time.sleep(0.02)
        with self._lock:
            return list(self.events)


# --------------------------------------------------------------------------- endpoints


def test_several_endpoints_make_one_balanced_target() -> None:
    addresses = parse_endpoints("127.0.0.1:1, http://127.0.0.1:2,127.0.0.2:3")
    assert addresses == [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.2", 3)]
    assert grpc_target(addresses) == "ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.2:3"
    assert grpc_target(parse_endpoints("[::1]:1,[::1]:2")) == "ipv6:[::1]:1,[::1]:2"
    assert grpc_target(parse_endpoints("etcd.ns.svc:2379")) == "etcd.ns.svc:2379"
    kv = EtcdKV("127.0.0.1:1,127.0.0.1:2", timeout=1.0)  # no connection is made yet
    assert kv.endpoint == "127.0.0.1:1,127.0.0.1:2"
    kv.close()


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        ("127.0.0.1:1,127.0.0.1:1", "name a member twice"),
        ("etcd-0:2379,etcd-1:2379", "must be IP addresses"),
        ("127.0.0.1:1,[::1]:2", "do not mix"),
        ("127.0.0.1:1,", "must look like"),
    ],
)
def test_bad_endpoint_lists_are_refused(endpoints: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EtcdKV(endpoints)


def test_start_etcd_takes_one_or_three_members(etcd_binary: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="etcd members 2; allowed: 1, 3"):
        start_etcd(etcd_binary, tmp_path, members=2, host="127.0.0.1")
    one = start_etcd(etcd_binary, tmp_path / "one", members=1, host="127.0.0.1")
    try:
        assert isinstance(one, EtcdServer) and "," not in one.endpoint
    finally:
        one.stop()


# --------------------------------------------------------------------------- the cluster


def test_cluster_starts_three_members_and_stops_each_by_pid(
    etcd_binary: str, tmp_path: Path
) -> None:
    with EtcdCluster.start(etcd_binary, tmp_path) as cluster:
        pids = cluster.pids
        assert len(set(pids)) == 3 and not any(gone(p) for p in pids)
        assert len(set(cluster.endpoint.split(","))) == 3
        assert cluster.leader() is not None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["member-0", "member-1", "member-2"]
        kv = EtcdKV(cluster.endpoint, timeout=2.0)
        revision = kv.put("/x", b"1", 2.0)
        # Every member serves what the others wrote.
        for member in cluster.members:
            single = EtcdKV(member.endpoint, timeout=2.0)
            got = single.get("/x", 2.0)
            assert got is not None and got.value == b"1" and got.mod_revision == revision
            single.close()
        kv.close()
    assert all(gone(p) for p in pids)


def _victim(cluster: EtcdCluster, which: str) -> int:
    leader = cluster.leader()
    assert leader is not None
    if which == "leader":
        return leader
    # A follower that serves some of the client's watch streams: they must move.
    watched = {
        i: (metrics(m.endpoint) or {}).get("etcd_debugging_mvcc_watcher_total", 0.0)
        for i, m in enumerate(cluster.members)
        if i != leader
    }
    best = max(watched, key=lambda i: watched[i])
    assert watched[best] > 0, f"no follower serves a watch: {watched}"
    return best


@pytest.mark.parametrize("which", ["leader", "watched follower"])
def test_the_client_carries_on_when_one_member_is_killed(cluster: EtcdCluster, which: str) -> None:
    kv = EtcdKV(cluster.endpoint, timeout=2.0)
    for _ in range(6):  # every member is connected (round robin) before the watches open
        kv.get("/warm", 2.0)
    lease = kv.grant_lease(1, 2.0)
    kv.put("/c/alive", b"yes", 2.0, lease=lease)
    stop_keepalive = kv.keepalive(lease, 0.25)
    recorders = [Recorder() for _ in range(6)]  # spread over the members
    cancels = [kv.watch_prefix("/c/w/", r) for r in recorders]
    kv.put("/c/w/1", b"before", 2.0)
    kv.put("/c/cas", b"0", 2.0)
    victim = cluster.members[_victim(cluster, which)]
    victim.kill()  # SIGKILL by PID
    assert not victim.running()

    _, write_outage = until_it_works(lambda: kv.put("/c/w/2", b"after", 1.0))
    got, _ = until_it_works(lambda: kv.get("/c/w/2", 1.0))
    assert got is not None and got.value == b"after"
    cas = kv.get("/c/cas", 2.0)
    assert cas is not None
    assert kv.compare_and_put("/c/cas", b"1", cas.mod_revision, 2.0)
    assert not kv.compare_and_put("/c/cas", b"2", cas.mod_revision, 2.0)  # stale: refused
    assert kv.create("/c/new", b"x", 2.0) and not kv.create("/c/new", b"y", 2.0)
    assert kv.delete("/c/w/1", 2.0)

    wanted = [("put", "/c/w/1", b"before"), ("put", "/c/w/2", b"after"), ("delete", "/c/w/1")]
    for recorder in recorders:
        seen = recorder.wait_for(3, 10.0)
        assert [(e.kind, e.key, e.value)[: 3 if e.value else 2] for e in seen] == wanted
        assert [e.revision for e in seen] == sorted({e.revision for e in seen})

    time.sleep(2.5)  # over twice the TTL: only refreshes on the surviving members keep it
    alive = kv.get("/c/alive", 2.0)
    assert alive is not None and alive.value == b"yes"
    for cancel in [*cancels, stop_keepalive]:
        cancel()
    kv.close()
    print(f"\nkilled the {which}: writes failed for {write_outage:.3f} s")


def test_without_a_quorum_every_call_ends_at_its_deadline(cluster: EtcdCluster) -> None:
    kv = EtcdKV(cluster.endpoint, timeout=1.0)
    kv.put("/q", b"v", 2.0)
    for member in cluster.members[:2]:
        member.kill()
    calls: list[Callable[[], object]] = [
        lambda: kv.put("/q", b"w", 1.0),
        lambda: kv.get("/q", 1.0),
        lambda: kv.compare_and_put("/q", b"w", 1, 1.0),
        lambda: kv.grant_lease(1, 1.0),
    ]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(KVError):
            call()
        assert time.monotonic() - start < 1.5
    kv.close()
