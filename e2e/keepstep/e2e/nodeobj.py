"""The Node and Lease objects a process-backed node keeps in the API server.

Where it sits: `noderunner.NodeRunner` applies `node_body` once when it registers, renews
`lease_body` every `heartbeat_s` and applies `node_status_body` every `status_every_s`.
The node lifecycle controller keeps a node Ready while either its Lease is renewed or its
Ready condition's heartbeat moves; once both stop for --node-monitor-grace-period it sets
the conditions to Unknown and taints the node. The bodies are server-side-apply patches:
the runner owns exactly the fields it sends. Pure functions of a `NodeConfig` and `now`.
"""

from __future__ import annotations

import ipaddress
import platform
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keepstep.e2e.podstatus import rfc3339

LEASE_NAMESPACE = "kube-node-lease"
FIELD_MANAGER = "keepstep-noderunner"
KUBELET_VERSION = "v1.34.4"  # the control plane's version: a node must not be newer
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def _default_capacity() -> dict[str, str]:
    return {"cpu": "8", "memory": "32Gi", "pods": "110"}


@dataclass(frozen=True)
class NodeConfig:
    """One process-backed node: its name and address, and how often it reports."""

    kubeconfig: Path
    name: str
    ip: str
    work_dir: Path
    heartbeat_s: float = 2.0  # Lease renewals
    status_every_s: float = 10.0  # Ready condition heartbeats
    lease_duration_s: int = 40
    request_timeout_s: float = 10.0  # every API call
    capacity: dict[str, str] = field(default_factory=_default_capacity, hash=False)
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, effect): keep pods away

    def __post_init__(self) -> None:
        if len(self.name) > 253 or not _DNS_SUBDOMAIN.match(self.name):
            raise ValueError(
                f"name={self.name!r} must be a DNS subdomain (lower-case letters, digits, "
                "'-' and '.', at most 253 characters)"
            )
        try:
            address = ipaddress.ip_address(self.ip)
        except ValueError:
            raise ValueError(f"ip={self.ip!r} must be an IPv4 address such as 127.0.1.1") from None
        if address.version != 4:
            raise ValueError(f"ip={self.ip!r} must be an IPv4 address such as 127.0.1.1")
        for what, value in (
            ("heartbeat_s", self.heartbeat_s),
            ("status_every_s", self.status_every_s),
            ("request_timeout_s", self.request_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{what}={value!r} must be > 0 seconds")
        if self.lease_duration_s < 1 or self.lease_duration_s <= self.heartbeat_s:
            raise ValueError(
                f"lease_duration_s={self.lease_duration_s} must be >= 1 and longer than "
                f"heartbeat_s={self.heartbeat_s}"
            )
        for resource in ("cpu", "memory", "pods"):
            if resource not in self.capacity:
                raise ValueError(f"capacity={self.capacity!r} lacks {resource!r}")
        for resource, quantity in self.capacity.items():
            if not _QUANTITY.match(quantity):
                raise ValueError(f"capacity[{resource!r}]={quantity!r} is not a quantity")
        for key, _value, effect in self.taints:
            if not key or effect not in TAINT_EFFECTS:
                raise ValueError(
                    f"taint ({key!r}, {effect!r}) needs a key and an effect in {TAINT_EFFECTS}"
                )


def node_body(cfg: NodeConfig) -> dict[str, Any]:
    """The labels a kubelet sets and the configured taints (none by default: the
    scheduler may bind any pod here)."""
    taints = [{"key": k, "value": v, "effect": e} for k, v, e in cfg.taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": cfg.name,
            "labels": {
                "kubernetes.io/hostname": cfg.name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": _arch(),
                "keepstep.dev/process-node": "true",
            },
        },
        "spec": {"taints": taints} if taints else {},
    }


def node_status_body(cfg: NodeConfig, now: datetime, ready_since: datetime) -> dict[str, Any]:
    """The node's status: Ready since `ready_since`, heartbeat `now`, no pressure."""
    beat, since = rfc3339(now), rfc3339(ready_since)

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": beat,
            "lastTransitionTime": since,
        }

    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": cfg.name},
        "status": {
            "capacity": dict(cfg.capacity),
            "allocatable": dict(cfg.capacity),
            "addresses": [
                {"type": "InternalIP", "address": cfg.ip},
                {"type": "Hostname", "address": cfg.name},
            ],
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                condition("Ready", "True", "KubeletReady", "process-backed node is posting"),
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "architecture": _arch(),
                "operatingSystem": "linux",
                "osImage": "keepstep process node",
                "kernelVersion": platform.release(),
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "process://1",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def lease_body(cfg: NodeConfig, now: datetime, node_uid: str | None) -> dict[str, Any]:
    """The node's Lease, renewed `now`; owned by the Node so it goes when the Node goes."""
    meta: dict[str, Any] = {"name": cfg.name, "namespace": LEASE_NAMESPACE}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": cfg.name, "uid": node_uid}
        ]
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": {
            "holderIdentity": cfg.name,
            "leaseDurationSeconds": cfg.lease_duration_s,
            "renewTime": micro_time(now),
        },
    }


def micro_time(at: datetime) -> str:
    """metav1.MicroTime: UTC with microseconds (naive means UTC)."""
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)
