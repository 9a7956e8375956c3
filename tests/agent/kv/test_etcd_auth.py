"""TLS and per-job auth on a real etcd: a job's certificate reaches its own prefix and
nothing else; no certificate, or one from another CA, reaches nothing; revoking a job ends
its access at once. Also the credential files and certificates themselves."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent.kv import KVDenied, KVError, WatchEvent
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.kv.etcd_auth import enable_auth, grant_job, job_user, revoke_job
from keepstep.agent.kv.etcd_pki import common_name, issue, make_ca
from keepstep.agent.protocol import job_prefix
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_cluster import EtcdCluster
from keepstep.launch.etcd_server import EtcdServer
from keepstep.launch.etcd_tls import LocalAuthority

T = 5.0


@pytest.fixture(scope="module")
def secured(
    etcd_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EtcdServer, LocalAuthority]]:
    """An etcd with TLS, client certificates required and auth on; jobs a and b granted."""
    folder = tmp_path_factory.mktemp("secured")
    authority = LocalAuthority.create(folder / "tls", ["127.0.0.1"])
    with EtcdServer.start(etcd_binary, folder / "etcd", tls=authority.server) as server:
        with EtcdKV(server.endpoint, credentials=authority.root) as root:
            enable_auth(root)
            enable_auth(root)  # idempotent
            for job in ("a", "b"):
                assert grant_job(root, job) == job_user(job)
            grant_job(root, "a")  # idempotent
        yield server, authority


def client(server: EtcdServer, authority: LocalAuthority, job: str) -> EtcdKV:
    folder = authority.job_credentials(job)
    return EtcdKV(server.endpoint, credentials=EtcdCredentials.from_dir(folder))


def test_a_job_reads_writes_watches_and_leases_its_own_prefix(
    secured: tuple[EtcdServer, LocalAuthority],
) -> None:
    server, authority = secured
    with client(server, authority, "a") as kv:
        own = job_prefix("a")
        seen: list[WatchEvent] = []
        got = threading.Event()

        def on_event(event: WatchEvent) -> None:
            seen.append(event)
            got.set()

        cancel = kv.watch_prefix(own, on_event)
        try:
            lease = kv.grant_lease(2, T)
            kv.put(own + "nodes/n0", b"x", T, lease=lease)
            assert kv.create(own + "epoch", b"1", T)
            assert [item.key for item in kv.get_prefix(own, T)] == [own + "epoch", own + "nodes/n0"]
            assert got.wait(T) and seen[0].key.startswith(own)
            lease.revoke(T)
            assert kv.delete_prefix(own, T) == 1
        finally:
            cancel()


@pytest.mark.parametrize(
    "call",
    ["get other", "put other", "prefix other", "watch other", "put root", "whole keyspace"],
)
def test_a_job_cannot_touch_another_jobs_prefix_or_any_other_key(
    secured: tuple[EtcdServer, LocalAuthority], call: str
) -> None:
    server, authority = secured
    with EtcdKV(server.endpoint, credentials=authority.root) as root:
        root.put(job_prefix("b") + "epoch", b"b's", T)
    with client(server, authority, "a") as kv:
        other = job_prefix("b")
        with pytest.raises(KVDenied, match="permission denied"):
            if call == "get other":
                kv.get(other + "epoch", T)
            elif call == "put other":
                kv.put(other + "leaving/n0", b"forged", T)
            elif call == "prefix other":
                kv.get_prefix(other, T)
            elif call == "watch other":
                kv.watch_prefix(other, lambda e: None)
            elif call == "put root":
                kv.put("/keepstep/operator", b"x", T)
            else:
                kv.get_prefix("", T)
    with EtcdKV(server.endpoint, credentials=authority.root) as root:
        held = root.get(job_prefix("b") + "epoch", T)
        assert held is not None and held.value == b"b's"
        assert root.get(job_prefix("b") + "leaving/n0", T) is None


def test_no_certificate_or_another_cas_certificate_reaches_nothing(
    secured: tuple[EtcdServer, LocalAuthority], tmp_path: Path
) -> None:
    server, authority = secured
    with EtcdKV(server.endpoint, timeout=1.0) as plain:
        with pytest.raises(KVError):
            plain.get(job_prefix("a") + "epoch", 1.0)
    stranger_ca = make_ca()
    pair = issue(stranger_ca, job_user("a"))  # the right name, the wrong signer
    forged = EtcdCredentials(authority.root.ca, pair.cert, pair.key)
    with EtcdKV(server.endpoint, timeout=1.0, credentials=forged) as kv:
        with pytest.raises(KVError):
            kv.get(job_prefix("a") + "epoch", 1.0)


def test_revoking_a_job_ends_its_access_at_once(
    secured: tuple[EtcdServer, LocalAuthority],
) -> None:
    server, authority = secured
    with EtcdKV(server.endpoint, credentials=authority.root) as root:
        grant_job(root, "gone")
        with client(server, authority, "gone") as kv:
            kv.put(job_prefix("gone") + "epoch", b"1", T)
            revoke_job(root, "gone")
            revoke_job(root, "gone")  # idempotent
            with pytest.raises(KVError, match=r"user name not found|permission denied"):
                kv.get(job_prefix("gone") + "epoch", T)


def test_auth_calls_need_a_tls_client(etcd_server: str) -> None:
    with EtcdKV(etcd_server) as kv:
        with pytest.raises(ConfigError, match="auth needs a TLS client"):
            grant_job(kv, "x")
    with pytest.raises(ConfigError, match=r"job 'a/b'"):
        job_user("a/b")
    # A Kubernetes job key may be 317 characters; a certificate's common name only 64.
    long_a, long_b = "n" * 63 + "." + "a" * 253, "n" * 63 + "." + "b" * 253
    assert len(job_user(long_a)) == 64 and job_user(long_a) != job_user(long_b)
    assert job_user(long_a).startswith("keepstep-job:nnn") and job_user(long_a) == job_user(long_a)
    assert job_user("ns.job") == "keepstep-job:ns.job"


def test_a_tls_cluster_of_three_forms_and_reports_its_leader_over_plain_metrics(
    etcd_binary: str, tmp_path: Path
) -> None:
    authority = LocalAuthority.create(tmp_path / "tls", ["127.0.0.1"])
    with EtcdCluster.start(etcd_binary, tmp_path / "etcd", tls=authority.server) as cluster:
        assert cluster.leader(timeout=2.0) is not None
        with EtcdKV(cluster.endpoint, credentials=authority.root) as root:
            enable_auth(root)
            grant_job(root, "c")
        with client_of(cluster.endpoint, authority, "c") as kv:
            kv.put(job_prefix("c") + "x", b"1", T)
            with pytest.raises(KVDenied):
                kv.get("x", T)


def client_of(endpoint: str, authority: LocalAuthority, job: str) -> EtcdKV:
    folder = authority.job_credentials(job)
    return EtcdKV(endpoint, credentials=EtcdCredentials.from_dir(folder))


def test_credentials_are_written_private_and_read_back_checked(tmp_path: Path) -> None:
    ca = make_ca()
    pair = issue(ca, "keepstep-job:x")
    folder = EtcdCredentials(ca.cert, pair.cert, pair.key).write(tmp_path / "creds")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for name in ("ca.crt", "tls.crt", "tls.key"):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600
    back = EtcdCredentials.from_dir(folder)
    assert back == EtcdCredentials(ca.cert, pair.cert, pair.key)
    assert "BEGIN" not in repr(back) and "hidden" in repr(back)
    assert common_name(back.cert) == "keepstep-job:x"
    (folder / "tls.key").write_text("not a key")
    with pytest.raises(ConfigError, match=r"tls\.key: not a PEM file"):
        EtcdCredentials.from_dir(folder)
    with pytest.raises(ConfigError, match=r"cannot read ca\.crt"):
        EtcdCredentials.from_dir(tmp_path / "missing")
    assert EtcdCredentials.from_env({}) is None


def test_certificates_say_what_is_wrong() -> None:
    ca = make_ca()
    with pytest.raises(ConfigError, match="needs at least one DNS name or IP"):
        issue(ca, "etcd", server=True)
    with pytest.raises(ConfigError, match="days=0"):
        issue(ca, "x", days=0)
    with pytest.raises(ConfigError, match="certificate 'x'"):
        issue(ca, "x", ips=["not-an-ip"])
    with pytest.raises(ConfigError, match=r"1\.\.64 characters"):
        issue(ca, "")
