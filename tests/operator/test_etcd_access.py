"""Each TrainJob's etcd access as the operator gives it: the CA loaded or made, a user
and a client-certificate Secret per job, pods that mount it, a user deleted with its job.
Against a real etcd with TLS and auth; the Secrets live in a dict standing in for the API
server (the API server's own part is `kube.Kube`'s two calls)."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from op_builders import ETCD, UID, job_object

from keepstep.agent.kv import KVDenied, KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.kv.etcd_pki import common_name
from keepstep.agent.protocol import job_prefix
from keepstep.launch.etcd_server import EtcdServer
from keepstep.launch.etcd_tls import ServerTLS
from keepstep.operator.errors import SpecError
from keepstep.operator.etcd_access import EtcdAuthority, JobAccess
from keepstep.operator.model import Job
from keepstep.operator.podspec import ETCD_TLS_DIR, etcd_tls_secret, pod_manifest
from keepstep.operator.settings import DecideConfig, OperatorSettings

T = 5.0


class Secrets:
    """Secrets by (namespace, name), as the API server would hold them."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def get_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        obj = self.objects.get((namespace, name))
        if obj is None:
            return None
        return {k: base64.b64decode(v) for k, v in obj["data"].items()}

    def create_secret(self, manifest: Mapping[str, Any]) -> None:
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        self.objects.setdefault(key, dict(manifest))

    def credentials(self, namespace: str, name: str) -> EtcdCredentials:
        data = self.get_secret(namespace, name)
        assert data is not None
        return EtcdCredentials(data["ca.crt"], data["tls.crt"], data["tls.key"])


@pytest.fixture(scope="module")
def cluster(
    etcd_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EtcdServer, Secrets, JobAccess]]:
    """An operator's CA made in an empty store, etcd serving its server certificate."""
    folder = tmp_path_factory.mktemp("operator-etcd")
    secrets = Secrets()
    authority = EtcdAuthority.load_or_create(secrets, "keepstep-system", "etcd-ca")
    authority.ensure_server_secret(secrets, "keepstep-system", "etcd-server", ["localhost"])
    tls_dir = secrets.credentials("keepstep-system", "etcd-server").write(folder / "server")
    tls = ServerTLS(tls_dir / "ca.crt", tls_dir / "tls.crt", tls_dir / "tls.key")
    with EtcdServer.start(etcd_binary, folder / "etcd", host="127.0.0.1", tls=tls) as server:
        # The certificate names localhost, not the address: dial it by that name.
        endpoint = "localhost:" + server.endpoint.rpartition(":")[2]
        with EtcdKV(endpoint, credentials=authority.root_credentials()) as root:
            yield server, secrets, JobAccess(authority, secrets, root)


def endpoint_of(server: EtcdServer) -> str:
    return "localhost:" + server.endpoint.rpartition(":")[2]


def test_the_ca_is_made_once_and_reused(tmp_path: Path) -> None:
    secrets = Secrets()
    first = EtcdAuthority.load_or_create(secrets, "ns", "ca")
    again = EtcdAuthority.load_or_create(secrets, "ns", "ca")
    assert first.ca == again.ca and len(secrets.objects) == 1
    secrets.objects[("ns", "broken")] = {"data": {"tls.crt": base64.b64encode(b"x").decode()}}
    with pytest.raises(ValueError, match=r"must hold the CA's tls\.crt and tls\.key"):
        EtcdAuthority.load_or_create(secrets, "ns", "broken")


def test_each_job_gets_a_secret_that_reaches_its_own_prefix_only(
    cluster: tuple[EtcdServer, Secrets, JobAccess],
) -> None:
    server, secrets, access = cluster
    a = Job.from_object({**job_object("alpha"), "metadata": _meta("alpha", "team-a", "uid-a")})
    b = Job.from_object({**job_object("beta"), "metadata": _meta("beta", "team-b", "uid-b")})
    for j in (a, b):
        access.ensure(j)
        access.ensure(j)  # once per uid: no second grant or Secret
    secret = secrets.objects[("team-a", etcd_tls_secret(a))]
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-a"  # goes with the job
    creds = secrets.credentials("team-a", etcd_tls_secret(a))
    assert common_name(creds.cert) == "keepstep-job:team-a.alpha"
    with EtcdKV(endpoint_of(server), credentials=creds) as kv:
        kv.put(job_prefix(a.key) + "epoch", b"1", T)
        with pytest.raises(KVDenied):
            kv.get_prefix(job_prefix(b.key), T)
        with pytest.raises(KVDenied):
            kv.put(job_prefix(b.key) + "done/n0-0", b"forged", T)


def test_a_deleted_jobs_certificate_names_no_user(
    cluster: tuple[EtcdServer, Secrets, JobAccess],
) -> None:
    server, secrets, access = cluster
    gone = Job.from_object({**job_object("gone"), "metadata": _meta("gone", "team-c", "uid-c")})
    access.ensure(gone)
    creds = secrets.credentials("team-c", etcd_tls_secret(gone))
    with EtcdKV(endpoint_of(server), credentials=creds) as kv:
        kv.put(job_prefix(gone.key) + "epoch", b"1", T)
        access.revoke(gone.key)
        with pytest.raises(KVError):
            kv.get(job_prefix(gone.key) + "epoch", T)


def test_pods_mount_the_jobs_credentials_whatever_the_template_says() -> None:
    template = {
        "spec": {
            "volumes": [{"name": "mine", "emptyDir": {}}],
            "volumeMounts": [{"name": "mine", "mountPath": ETCD_TLS_DIR}],
        }
    }
    obj = job_object()
    obj["spec"]["podTemplate"] = template
    j = Job.from_object(obj)
    pod = pod_manifest(j, 0, ETCD, etcd_tls=True)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["keepstep-etcd-tls"]["secret"]["secretName"] == etcd_tls_secret(j)
    container = pod["spec"]["containers"][0]
    mounts = [m for m in container["volumeMounts"] if m["mountPath"] == ETCD_TLS_DIR]
    assert mounts == [{"name": "keepstep-etcd-tls", "mountPath": ETCD_TLS_DIR, "readOnly": True}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KEEPSTEP_ETCD_TLS_DIR"] == ETCD_TLS_DIR
    plain = pod_manifest(j, 0, ETCD)
    assert "KEEPSTEP_ETCD_TLS_DIR" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


def test_settings_say_what_the_etcd_flags_need() -> None:
    assert DecideConfig.of(OperatorSettings(ETCD, etcd_ca_secret="ns/ca")).etcd_tls
    assert not DecideConfig.of(OperatorSettings(ETCD)).etcd_tls
    with pytest.raises(SpecError, match="namespace/name"):
        OperatorSettings(ETCD, etcd_ca_secret="ca")
    with pytest.raises(SpecError, match="needs etcd_ca_secret"):
        OperatorSettings(ETCD, etcd_server_secret="server")


def _meta(name: str, namespace: str, uid: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "uid": uid, "generation": 1}


assert UID  # the builders' default uid stays distinct from the ones above
