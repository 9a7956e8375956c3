"""How `EtcdKV` reaches etcd: the endpoints it is given, and the one gRPC channel over them.

Where it sits: under `keepstep.agent.kv.etcd`, which calls `parse_endpoints` on what the
agent was configured with ("host:port", or "h:p1,h:p2,h:p3" for the members of a cluster)
and `open_channel` on the result. The channel balances round-robin over every address, so
calls and streams are spread over the members, and a member whose connection broke is
skipped until it is back; a single DNS name whose answer lists every member is balanced
the same way.
"""

from __future__ import annotations

import ipaddress
import json

import grpc

from keepstep.errors import ConfigError

__all__ = ["grpc_target", "open_channel", "parse_endpoint", "parse_endpoints"]

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


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split "host:port" (an "http://" in front is accepted) into (host, port)."""
    text = endpoint.removeprefix("http://").rstrip("/")
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


def open_channel(addresses: list[tuple[str, int]]) -> grpc.Channel:
    """An insecure channel over every address (see the module docstring)."""
    return grpc.insecure_channel(grpc_target(addresses), options=_GRPC_OPTIONS)
