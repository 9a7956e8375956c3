"""Two TrainJobs on one job etcd with TLS and auth, on the real control plane: each job's
pods get their own etcd user through the Secret the operator makes; with the other job's
credentials (or none) nothing of the first job can be read or written, the first job ends
with the fault-free parameters, and deleting a job deletes its etcd user.

The etcd is started from the CA the operator uses (made here first, as cert-manager would,
in the test's namespace) with a server certificate for 127.0.0.1; the operator runs with
--etcd-ca-secret, the pods mount the Secret on process-backed nodes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent.kv import KVDenied, KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.protocol import job_prefix
from keepstep.e2e.controlplane import ControlPlane, build_binaries
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_server import EtcdServer, find_etcd
from keepstep.launch.etcd_tls import ServerTLS
from keepstep.operator.connection import load_connection
from keepstep.operator.etcd_access import EtcdAuthority
from keepstep.operator.kube import Kube

from .test_training import reference, succeeded, trainjob
from .training_fixtures import OPERATOR_FLAGS, Training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

__all__ = ["reference"]  # the fixture, used below

T = 5.0


@pytest.fixture
def secured(
    trainjob_crd: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[tuple[Training, Kube]]:
    """A TLS job etcd from the operator's CA, and a `Training` whose operator uses it."""
    kube = Kube(load_connection(str(trainjob_crd.kubeconfig)))
    authority = EtcdAuthority.load_or_create(kube, namespace, "etcd-ca")
    authority.ensure_server_secret(kube, namespace, "etcd-server", ["127.0.0.1"])
    server = creds(kube, namespace, "etcd-server").write(tmp_path / "etcd-server")
    tls = ServerTLS(server / "ca.crt", server / "tls.crt", server / "tls.key")
    try:
        binary = find_etcd(os.environ)
    except ConfigError:
        binary = str(build_binaries() / "etcd")
    with EtcdServer.start(binary, tmp_path / "etcd", tls=tls) as etcd:
        flags = (*OPERATOR_FLAGS, "--etcd-ca-secret", f"{namespace}/etcd-ca")
        cluster = Training(
            trainjob_crd,
            f"https://{etcd.endpoint}",
            namespace,
            tmp_path,
            operator_flags=flags,
            credentials=authority.root_credentials(),
        )
        try:
            cluster.operator.start()
            yield cluster, kube
        finally:
            left = cluster.close()
        assert not left, f"processes outlived the test (killed now): {left}"


def creds(kube: Kube, namespace: str, secret: str) -> EtcdCredentials:
    data = kube.get_secret(namespace, secret)
    assert data is not None, f"no Secret {namespace}/{secret}"
    return EtcdCredentials(data["ca.crt"], data["tls.crt"], data["tls.key"])


def secret_of(t: Training, kube: Kube, name: str) -> EtcdCredentials | None:
    data = kube.get_secret(t.namespace, f"{name}-etcd-tls")
    return (
        None if data is None else EtcdCredentials(data["ca.crt"], data["tls.crt"], data["tls.key"])
    )


@pytest.mark.timeout(240)
def test_a_job_cannot_reach_another_jobs_records(
    secured: tuple[Training, Kube], reference: str
) -> None:
    t, kube = secured
    for _ in range(3):
        t.add_node()
    t.apply(trainjob("alpha"))
    other: dict[str, Any] = trainjob("beta")
    other["spec"]["suspend"] = True  # its etcd user and Secret exist; no pod trains
    t.apply(other)
    beta = t.wait("beta's Secret", lambda: secret_of(t, kube, "beta"))
    t.wait("alpha's step 5", lambda: (c := t.committed("alpha")) >= 5 and c, timeout=120)
    alpha = job_prefix(t.job_key("alpha"))
    with EtcdKV(t.etcd, timeout=T, credentials=beta) as kv:
        with pytest.raises(KVDenied):
            kv.get_prefix(alpha, T)
        with pytest.raises(KVDenied):
            kv.put(alpha + "leaving/alpha-node-0", b"{}", T)  # a drain
        with pytest.raises(KVDenied):
            kv.put(alpha + "done/alpha-node-0-0", b"{}", T)  # a forged end
        kv.put(job_prefix(t.job_key("beta")) + "probe", b"mine", T)  # its own prefix works
    with EtcdKV(t.etcd, timeout=1.0) as plain:
        with pytest.raises(KVError):
            plain.get_prefix(alpha, 1.0)
    succeeded(t, "alpha", reference)
    # Deleting beta deletes its etcd user: its certificate names nobody any more.
    t.kubectl("delete", "trainjob", "beta", "--wait=true", "--timeout=60s")
    with EtcdKV(t.etcd, timeout=T, credentials=beta) as kv:
        with pytest.raises(KVError, match=r"user name not found|permission denied"):
            kv.get_prefix(job_prefix(t.job_key("beta")), T)
