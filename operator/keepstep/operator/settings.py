"""The operator's configuration: one frozen value built at the entry point.

`python -m keepstep.operator` turns its flags into an `OperatorSettings`; every other
module receives it (or the part it needs) as an argument and never reads the environment.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from keepstep.operator.agent_defaults import AgentEnv, check_agent_env
from keepstep.operator.errors import SpecError

_HEALTH = re.compile(r"http://[^/:\s]+:(\d{1,5})/\S*")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise SpecError(f"{name}={value!r} must be a finite number of seconds > 0")


@dataclass(frozen=True)
class Endpoint:
    """Where one of the operator's HTTP endpoints listens: http://HOST:PORT/PATH."""

    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, name: str, url: str) -> Endpoint:
        """`url` taken apart; a SpecError naming `name` and the rule if it is not an http
        URL with a host, a port 1-65535 and a path (and nothing else)."""
        bad = SpecError(
            f"{name}={url!r} must be an http URL with a host, a port 1-65535 and a path "
            "(no query, no user), such as http://0.0.0.0:8081/metrics"
        )
        try:
            parts = urlsplit(url)
            port = parts.port
        except (ValueError, TypeError):  # not a string, a bad IPv6 host, a port not 0-65535
            raise bad from None
        if (
            parts.scheme != "http"
            or not parts.hostname
            or port is None
            or port < 1
            or not parts.path.startswith("/")
            or parts.query
            or parts.fragment
            or parts.username is not None
        ):
            raise bad
        return cls(parts.hostname, port, parts.path)


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator needs to run.

    etcd: the client URL of the job etcd, also handed to every agent as KEEPSTEP_ETCD_ENDPOINTS.
    namespaces: the namespaces to watch (a namespaced install: a Role in each); empty
        watches all of them (a cluster-wide install: one ClusterRole).
    lost_pod_grace_s: how long a Running pod's agent may be missing from etcd, while its
        job runs, before the pod counts as lost (a killed node leaves its pod "Running").
    below_min_grace_s: how long a running job may have fewer than minNodes live agents
        before it is marked Failed.
    agent_start_grace_s: how long a running pod's agent may take to register for the
        first time (it imports torch and builds its model) before the pod counts as lost.
    resync_s: a job is reconciled at least this often even when nothing signals a change
        (agent progress reaches status this way).
    pending_grace_s, backoff_limit, failure_window_s: the defaults of a TrainJob's
        spec.failurePolicy (pendingTimeoutSeconds, backoffLimit, windowSeconds).
    backoff_base_s, backoff_max_s: pod creation after a failure waits base * 2**(n-1)
        seconds, at most max (see `failures`).
    etcd_ca_secret: "namespace/name" of the job etcd's CA (a TLS Secret: tls.crt, tls.key),
        made there if missing; with it the operator speaks TLS to etcd as its root user and
        gives each TrainJob an etcd user and a client-certificate Secret (`etcd_access`).
        None: plain gRPC and no etcd auth (a development etcd only).
    agent_env: (name, value) defaults of every agent container's environment, for the
        names its job's trainer.env leaves unset (`agent_defaults`).
    """

    etcd: str
    namespaces: tuple[str, ...] = ()
    kubeconfig: str | None = None
    lost_pod_grace_s: float = 15.0
    below_min_grace_s: float = 120.0
    agent_start_grace_s: float = 120.0
    resync_s: float = 5.0
    api_timeout_s: float = 10.0
    etcd_timeout_s: float = 5.0
    create_parallelism: int = 16
    pending_grace_s: float = 300.0
    backoff_limit: int = 6
    failure_window_s: float = 600.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    standalone: bool = True
    peering: str | None = None
    # kopf's liveness endpoint ("http://0.0.0.0:8080/healthz"): the pod's liveness and
    # readiness probes; None serves none.
    health: str | None = None
    # The operator's Prometheus metrics ("http://0.0.0.0:8081/metrics", `metrics`); None
    # serves none.
    metrics: str | None = None
    etcd_ca_secret: str | None = None
    # The etcd members' server certificate Secret (in the CA's namespace), made if missing
    # for these DNS names; None: made by whoever runs etcd.
    etcd_server_secret: str | None = None
    etcd_server_names: tuple[str, ...] = ()
    agent_env: AgentEnv = ()

    @property
    def metrics_endpoint(self) -> Endpoint | None:
        return None if self.metrics is None else Endpoint.parse("metrics", self.metrics)

    def __post_init__(self) -> None:
        if self.etcd_server_secret and not (self.etcd_ca_secret and self.etcd_server_names):
            raise SpecError(
                f"etcd_server_secret={self.etcd_server_secret!r} needs etcd_ca_secret and "
                "etcd_server_names (the names the members answer to)"
            )
        if self.etcd_ca_secret is not None and self.etcd_ca_secret.count("/") != 1:
            raise SpecError(
                f"etcd_ca_secret={self.etcd_ca_secret!r} must be namespace/name of a Secret"
            )
        if not self.etcd or not isinstance(self.etcd, str):
            raise SpecError(f"etcd={self.etcd!r} must be a client URL such as http://host:2379")
        for namespace in self.namespaces:
            if not namespace or not isinstance(namespace, str):
                raise SpecError(f"namespaces={self.namespaces!r}: {namespace!r} is not a namespace")
        if len(set(self.namespaces)) != len(self.namespaces):
            raise SpecError(f"namespaces={self.namespaces!r} names a namespace twice")
        health = _HEALTH.fullmatch(self.health) if self.health is not None else None
        if self.health is not None and health is None:
            raise SpecError(
                f"health={self.health!r} must be an http URL with a port and a path, such as "
                "http://0.0.0.0:8080/healthz"
            )
        metrics = self.metrics_endpoint
        if metrics is not None and health is not None and int(health[1]) == metrics.port:
            raise SpecError(
                f"metrics={self.metrics!r} and health={self.health!r} must listen on "
                "different ports"
            )
        _positive("lost_pod_grace_s", self.lost_pod_grace_s)
        _positive("agent_start_grace_s", self.agent_start_grace_s)
        _positive("below_min_grace_s", self.below_min_grace_s)
        _positive("resync_s", self.resync_s)
        _positive("api_timeout_s", self.api_timeout_s)
        _positive("etcd_timeout_s", self.etcd_timeout_s)
        DecideConfig.of(self)  # the decision's part, checked the same way
        if not (isinstance(self.create_parallelism, int) and 1 <= self.create_parallelism <= 64):
            raise SpecError(f"create_parallelism={self.create_parallelism!r} must be 1..64")
        if self.standalone and self.peering is not None:
            raise SpecError(
                f"peering={self.peering!r} needs standalone=False: a standalone operator "
                "does not take part in peering"
            )


@dataclass(frozen=True)
class DecideConfig:
    """The part of the settings a decision uses: what pods are told, and its time limits."""

    etcd: str
    lost_pod_s: float = 15.0
    below_min_s: float = 120.0
    agent_start_s: float = 120.0
    pending_s: float = 300.0
    backoff_limit: int = 6
    failure_window_s: float = 600.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    # Pods mount their job's etcd credentials (`etcd_access`); False: plain etcd.
    etcd_tls: bool = False
    # Defaults of every agent container's environment (`agent_defaults`).
    agent_env: AgentEnv = ()

    def __post_init__(self) -> None:
        if not self.etcd:
            raise SpecError("etcd='' must be the client URL the agents are given")
        _positive("lost_pod_s", self.lost_pod_s)
        _positive("below_min_s", self.below_min_s)
        _positive("agent_start_s", self.agent_start_s)
        _positive("pending_s", self.pending_s)
        _positive("failure_window_s", self.failure_window_s)
        _positive("backoff_base_s", self.backoff_base_s)
        _positive("backoff_max_s", self.backoff_max_s)
        if isinstance(self.backoff_limit, bool) or not isinstance(self.backoff_limit, int):
            raise SpecError(f"backoff_limit={self.backoff_limit!r} must be an integer >= 0")
        if self.backoff_limit < 0:
            raise SpecError(f"backoff_limit={self.backoff_limit} must be >= 0")
        if self.backoff_max_s < self.backoff_base_s:
            raise SpecError(
                f"backoff_max_s={self.backoff_max_s:g} must be >= backoff_base_s="
                f"{self.backoff_base_s:g}"
            )
        check_agent_env(self.agent_env)

    @classmethod
    def of(cls, settings: OperatorSettings) -> DecideConfig:
        return cls(
            settings.etcd,
            settings.lost_pod_grace_s,
            settings.below_min_grace_s,
            settings.agent_start_grace_s,
            settings.pending_grace_s,
            settings.backoff_limit,
            settings.failure_window_s,
            settings.backoff_base_s,
            settings.backoff_max_s,
            etcd_tls=settings.etcd_ca_secret is not None,
            agent_env=settings.agent_env,
        )
