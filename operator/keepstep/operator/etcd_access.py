"""Each TrainJob's own way into the job etcd: a user, a role on its prefix, a Secret.

Where it sits: `__main__` loads the CA with `EtcdAuthority.load_or_create` when the
operator runs with --etcd-ca-secret, acts as etcd's root user with `root_credentials`, and
hands a `JobAccess` to the reconciler and the delete handler. Before a job's first pod,
`JobAccess.ensure` grants the job an etcd user whose role reads and writes
/keepstep/jobs/<namespace>.<name>/ only (`keepstep.agent.kv.etcd_auth`) and creates the
Secret <job>-etcd-tls in the job's namespace (ca.crt, tls.crt, tls.key; owned by the
TrainJob, so it goes with it); the pods mount it (`podspec`). `revoke` deletes the user
and role when the TrainJob is deleted: a certificate that outlives its job names no user.

Which CA: the Secret the flag names (a kubernetes.io/tls Secret: tls.crt and tls.key of a
CA). If it is missing the operator makes one there, so an install needs nothing else; a
cluster with cert-manager can create it instead (a CA Certificate whose secretName is
that Secret), and the operator uses what it finds. The etcd members' server certificate
comes from the same CA: `ensure_server_secret` makes it once, with the names the etcd
Service and its peers answer to.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.kv.etcd_auth import ROOT_USER, enable_auth, grant_job, job_user, revoke_job
from keepstep.agent.kv.etcd_channel import SERVER_NAME
from keepstep.agent.kv.etcd_pki import KeyPair, issue, make_ca
from keepstep.operator.model import JOB_LABEL, Job
from keepstep.operator.podspec import MANAGED_BY, etcd_tls_secret, owner_reference

__all__ = ["EtcdAuthority", "JobAccess", "SecretStore"]

log = logging.getLogger(__name__)


class SecretStore(Protocol):
    """What this module needs of the API server (`kube.Kube`)."""

    def get_secret(self, namespace: str, name: str) -> dict[str, bytes] | None: ...
    def create_secret(self, manifest: Mapping[str, Any]) -> None: ...


class EtcdAuthority:
    """The CA of the job etcd, as loaded from (or made into) its Secret."""

    def __init__(self, ca: KeyPair) -> None:
        self.ca = ca

    @classmethod
    def load_or_create(cls, kube: SecretStore, namespace: str, name: str) -> EtcdAuthority:
        data = kube.get_secret(namespace, name)
        if data is None:
            ca = make_ca()
            kube.create_secret(tls_secret(namespace, name, ca, ca.cert))
            data = kube.get_secret(namespace, name)  # another replica may have won the race
            log.info("made the job etcd's CA in Secret %s/%s", namespace, name)
        if data is None or "tls.crt" not in data or "tls.key" not in data:
            raise ValueError(f"Secret {namespace}/{name} must hold the CA's tls.crt and tls.key")
        return cls(KeyPair(data["tls.crt"], data["tls.key"]))

    def root_credentials(self) -> EtcdCredentials:
        """What the operator presents to etcd: a certificate naming the root user."""
        pair = issue(self.ca, ROOT_USER, days=30)
        return EtcdCredentials(self.ca.cert, pair.cert, pair.key)

    def ensure_server_secret(
        self, kube: SecretStore, namespace: str, name: str, dns: Sequence[str]
    ) -> None:
        """Make the etcd members' server certificate Secret if it is missing, valid for
        `dns` (names, or IP addresses)."""
        if kube.get_secret(namespace, name) is not None:
            return
        ips = [n for n in dns if _is_ip(n)]  # a test's etcd on loopback is dialled by address
        names = [SERVER_NAME, *(n for n in dns if not _is_ip(n))]
        pair = issue(self.ca, "keepstep-etcd", dns=names, ips=ips, server=True)
        kube.create_secret(tls_secret(namespace, name, pair, self.ca.cert))

    def job_credentials(self, job: Job) -> KeyPair:
        return issue(self.ca, job_user(job.key), days=365)


class JobAccess:
    """Grants and revokes TrainJobs' etcd access (see the module docstring)."""

    def __init__(self, authority: EtcdAuthority, kube: SecretStore, root: EtcdKV) -> None:
        self.authority, self.kube, self.root = authority, kube, root
        self._granted: dict[str, str] = {}  # job key -> the uid whose user and Secret exist
        self._lock = threading.Lock()
        self._auth_on = False

    def ensure(self, job: Job) -> None:
        """Give `job` its etcd user and Secret unless it has them; raises KVError or
        KubeError when etcd or the API server refused (the reconcile is retried)."""
        with self._lock:
            if self._granted.get(job.key) == job.uid:
                return
        if not self._auth_on:
            enable_auth(self.root)
            self._auth_on = True
        grant_job(self.root, job.key)
        name = etcd_tls_secret(job)
        if self.kube.get_secret(job.namespace, name) is None:
            pair = self.authority.job_credentials(job)
            secret = tls_secret(job.namespace, name, pair, self.authority.ca.cert)
            secret["metadata"]["labels"] = {
                JOB_LABEL: job.name,
                "app.kubernetes.io/managed-by": MANAGED_BY,
            }
            secret["metadata"]["ownerReferences"] = [owner_reference(job)]
            self.kube.create_secret(secret)
            log.info("%s: granted its etcd prefix; credentials in Secret %s", job.key, name)
        with self._lock:
            self._granted[job.key] = job.uid

    def revoke(self, key: str) -> None:
        """Delete the job's etcd user and role ("<namespace>.<name>")."""
        revoke_job(self.root, key)
        with self._lock:
            self._granted.pop(key, None)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def tls_secret(namespace: str, name: str, pair: KeyPair, ca: bytes) -> dict[str, Any]:
    """A kubernetes.io/tls Secret with the CA beside the pair (ca.crt, tls.crt, tls.key)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"ca.crt": b64(ca), "tls.crt": b64(pair.cert), "tls.key": b64(pair.key)},
    }
