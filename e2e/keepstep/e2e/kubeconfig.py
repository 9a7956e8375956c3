"""Credentials of the local test cluster, its admin kubeconfig, and a bare HTTPS GET.

Where it sits: `ControlPlane.start` makes a random admin token (a static token file; the
user is in system:masters), an RSA key pair that signs and checks service-account tokens,
and the kubeconfig every client uses. The kube-apiserver writes its own self-signed serving
certificate (with its CA) into --cert-dir; the kubeconfig trusts exactly that file, so no
client skips TLS verification. `AdminAccess.get` is what readiness waits use: one urllib
request, no kubectl process per poll.
"""

from __future__ import annotations

import json
import secrets
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

_CLUSTER, _USER = "keepstep-e2e", "admin"


@dataclass(frozen=True)
class AdminAccess:
    """How an admin reaches the API server: its URL, a bearer token, the CA file to trust."""

    server: str
    token: str
    ca_file: Path

    def __post_init__(self) -> None:
        if not self.server.startswith("https://"):
            raise ValueError(f"server={self.server!r} must be an https:// URL")
        if not self.token:
            raise ValueError("the admin token must not be empty")

    def get(self, path: str, *, timeout: float) -> tuple[int, bytes]:
        """GET `path`; returns (HTTP status, body), or (0, b"") if nothing answered."""
        if not self.ca_file.exists():
            return 0, b""  # the API server has not written its certificate yet
        context = ssl.create_default_context(cafile=str(self.ca_file))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),  # loopback never goes through a proxy
            urllib.request.HTTPSHandler(context=context),
        )
        request = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with opener.open(request, timeout=timeout) as response:
                return int(response.status), bytes(response.read())
        except urllib.error.HTTPError as err:
            return int(err.code), bytes(err.read())
        except (OSError, ssl.SSLError):
            return 0, b""


def new_token() -> str:
    return secrets.token_hex(16)


def write_token_file(path: Path, token: str) -> None:
    """The --token-auth-file: one admin user in the system:masters group."""
    path.write_text(f"{token},{_USER},{_USER},system:masters\n")
    path.chmod(0o600)


def write_service_account_keys(private: Path, public: Path) -> None:
    """An RSA key pair: the controller-manager and API server sign tokens with `private`,
    the API server checks them with `public`."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def write_kubeconfig(path: Path, access: AdminAccess) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": _CLUSTER,
                "cluster": {
                    "server": access.server,
                    "certificate-authority": str(access.ca_file),
                },
            }
        ],
        "users": [{"name": _USER, "user": {"token": access.token}}],
        "contexts": [{"name": _CLUSTER, "context": {"cluster": _CLUSTER, "user": _USER}}],
        "current-context": _CLUSTER,
    }
    # JSON is YAML: kubectl and every client library read it, and no YAML library is needed.
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
