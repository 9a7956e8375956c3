"""TLS and auth for a private etcd: the authority `keepstep run` makes for each run.

Where it sits: `run.Launcher` calls `LocalAuthority.create` in the run's folder, starts its
etcd with `authority.server` (TLS on the client and peer ports, client certificates
required), enables auth and grants the job its prefix with the root credentials
(`keepstep.agent.kv.etcd_auth`), and hands each agent the folder `job_credentials` wrote.
So a local run goes through the same code as a pod on a cluster: TLS, a certificate that
names the job's etcd user, a role that covers the job's prefix and nothing else. Another
local user who reaches the port gets no answer without a certificate from this run's CA,
whose key stays in the run's 0700 folder.

etcd's /health and /metrics are served on a separate plain-HTTP port on the same host
(`--listen-metrics-urls`): they hold no keys, and the launcher and the chaos harness read
them without credentials.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keepstep.agent.kv.etcd_auth import ROOT_USER, job_user
from keepstep.agent.kv.etcd_channel import SERVER_NAME, EtcdCredentials
from keepstep.agent.kv.etcd_pki import KeyPair, issue, make_ca

__all__ = ["LocalAuthority", "ServerTLS"]


@dataclass(frozen=True)
class ServerTLS:
    """The files an etcd member serves TLS with and checks its clients and peers by."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    def args(self) -> list[str]:
        """etcd's flags for TLS on both ports with certificates required of both sides."""
        return [
            f"--trusted-ca-file={self.ca_file}",
            f"--cert-file={self.cert_file}",
            f"--key-file={self.key_file}",
            "--client-cert-auth",
            f"--peer-trusted-ca-file={self.ca_file}",
            f"--peer-cert-file={self.cert_file}",
            f"--peer-key-file={self.key_file}",
            "--peer-client-cert-auth",
        ]


class LocalAuthority:
    """A CA in `folder` (0700), the server certificate of the etcd members on `hosts`, and
    the root user's client credentials."""

    def __init__(self, folder: Path, ca: KeyPair, server: ServerTLS, root: EtcdCredentials):
        self.folder = folder
        self._ca = ca
        self.server = server
        self.root = root

    @classmethod
    def create(cls, folder: Path, hosts: Sequence[str]) -> LocalAuthority:
        ca = make_ca("keepstep run etcd CA", days=30)
        dns = [SERVER_NAME, "localhost"]  # SERVER_NAME: what a client of several members checks
        pair = issue(ca, "keepstep-etcd", ips=list(hosts), dns=dns, server=True)
        server_dir = EtcdCredentials(ca.cert, pair.cert, pair.key).write(folder / "server")
        server = ServerTLS(server_dir / "ca.crt", server_dir / "tls.crt", server_dir / "tls.key")
        root_pair = issue(ca, ROOT_USER)
        root = EtcdCredentials(ca.cert, root_pair.cert, root_pair.key)
        return cls(folder, ca, server, root)

    def job_credentials(self, job: str) -> Path:
        """Write the client credentials of `job`'s etcd user; return their folder."""
        pair = issue(self._ca, job_user(job))
        return EtcdCredentials(self._ca.cert, pair.cert, pair.key).write(self.folder / "job")
