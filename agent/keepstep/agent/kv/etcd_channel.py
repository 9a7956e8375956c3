"""How `EtcdKV` reaches etcd: the endpoints it is given, and the one gRPC channel over them.

Where it sits: under `keepstep.agent.kv.etcd`, which calls `parse_endpoints` on what the
agent was configured with ("host:port", or "h:p1,h:p2,h:p3" for the members of a cluster)
and `open_channel` on the result. The channel balances round-robin over every address, so
calls and streams are spread over the members, and a member whose connection broke is
skipped until it is back; a single DNS name whose answer lists every member is balanced
the same way.

With `EtcdCredentials` (a CA, a client certificate and its key, as a Kubernetes TLS Secret
holds them: ca.crt, tls.crt, tls.key) the channel is TLS: the server must prove a name or
address it was dialled by with a certificate from that CA, and the client certificate's
common name is the etcd user the calls act as (see `etcd_pki`). Dialling several
addresses, the client checks each server's certificate for the name `SERVER_NAME`.
Without credentials it is plain gRPC, for a test's own etcd on loopback.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from keepstep.errors import ConfigError

__all__ = [
    "SERVER_NAME",
    "TLS_DIR_ENV",
    "EtcdCredentials",
    "grpc_target",
    "open_channel",
    "parse_endpoint",
    "parse_endpoints",
]

# The name a client checks the server's certificate for when it dials several addresses (one
# name cannot be every member's address): the certificates keepstep issues carry it.
SERVER_NAME = "keepstep-etcd"
TLS_DIR_ENV = "KEEPSTEP_ETCD_TLS_DIR"  # where a pod's Secret volume puts its credentials
_FILES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
_MAX_PEM = 64 * 1024  # a CA bundle and one chain are a few KiB

_GRPC_OPTIONS = [
    # Reconnect quickly after an etcd restart (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Notice a silently dead peer under an open watch. etcd refuses pings closer than 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Every member gets calls; one that is down is skipped until it reconnects.
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
]


@dataclass(frozen=True)
class EtcdCredentials:
    """Who a client is to etcd: the CA its servers are signed by, and a client certificate
    (PEM) with its key. `repr` never shows the key."""

    ca: bytes
    cert: bytes
    key: bytes

    def __repr__(self) -> str:
        return f"EtcdCredentials(cert={len(self.cert)} bytes, key=<hidden>)"

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> EtcdCredentials:
        """Read ca.crt, tls.crt and tls.key from `path` (a mounted TLS Secret)."""
        folder = Path(path)
        parts: dict[str, bytes] = {}
        for field, name in _FILES.items():
            file = folder / name
            try:
                with open(file, "rb") as f:
                    data = f.read(_MAX_PEM + 1)
            except OSError as err:
                raise ConfigError(
                    f"etcd credentials {folder}: cannot read {name} ({err.strerror}); the "
                    "folder must hold ca.crt, tls.crt and tls.key (a TLS Secret's keys)"
                ) from None
            if len(data) > _MAX_PEM or b"-----BEGIN " not in data:
                raise ConfigError(f"etcd credentials {file}: not a PEM file of <= 64 KiB")
            parts[field] = data
        return cls(**parts)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EtcdCredentials | None:
        """The credentials in the folder $KEEPSTEP_ETCD_TLS_DIR names (None: unset)."""
        folder = env.get(TLS_DIR_ENV)
        return cls.from_dir(folder) if folder else None

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the three files into `path` (made 0700; the files 0600) and return it."""
        folder = Path(path)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        for field, name in _FILES.items():
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(getattr(self, field))
        return folder


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split "host:port" (an "http://" or "https://" in front is accepted) into (host, port)."""
    text = endpoint.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"etcd endpoint {endpoint!r} must look like 127.0.0.1:2379")
    return host, int(port)


def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """Split "h:p,h:p,..." (each as `parse_endpoint` takes it) into (host, port) pairs."""
    out = [parse_endpoint(part.strip()) for part in endpoints.split(",")]
    if len(set(out)) < len(out):
        raise ConfigError(f"etcd endpoints {endpoints!r} name a member twice")
    return out


def grpc_target(addresses: list[tuple[str, int]]) -> str:
    """The gRPC target of one endpoint (a name is resolved by DNS) or of several (IP
    addresses only: gRPC has no resolver for a list of names)."""
    if len(addresses) == 1:
        host, port = addresses[0]
        return f"{host}:{port}"
    versions = set()
    for host, _ in addresses:
        try:
            versions.add(ipaddress.ip_address(host.strip("[]")).version)
        except ValueError:
            raise ConfigError(
                f"etcd endpoint {host!r}: several endpoints must be IP addresses (a single "
                "DNS name whose answer lists every member also works)"
            ) from None
    if versions == {4}:
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in addresses)
    if versions == {6}:
        return "ipv6:" + ",".join(f"[{h.strip('[]')}]:{p}" for h, p in addresses)
    raise ConfigError(f"etcd endpoints {addresses}: do not mix IPv4 and IPv6 addresses")


def open_channel(
    addresses: list[tuple[str, int]], credentials: EtcdCredentials | None = None
) -> grpc.Channel:
    """A channel over every address: TLS with `credentials`, else plain (see the module
    docstring)."""
    target = grpc_target(addresses)
    if credentials is None:
        return grpc.insecure_channel(target, options=_GRPC_OPTIONS)
    tls = grpc.ssl_channel_credentials(
        root_certificates=credentials.ca,
        private_key=credentials.key,
        certificate_chain=credentials.cert,
    )
    options = list(_GRPC_OPTIONS)
    if len(addresses) > 1:
        options.append(("grpc.ssl_target_name_override", SERVER_NAME))
    return grpc.secure_channel(target, tls, options=options)
