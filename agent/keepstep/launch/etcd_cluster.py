"""A private etcd cluster of several members on one host, as production runs etcd.

Where it sits: `keepstep run --etcd-members 3` (run.py) and the integration tests start one
with `EtcdCluster.start`; the agents get its `endpoint` ("h:p1,h:p2,h:p3") and reach it
through `keepstep.agent.kv.etcd.EtcdKV`, which spreads calls over the members and moves to
the others when one dies. With three members the job survives the loss of any one: the
other two still form a quorum (a lost leader is replaced after one election timeout).

The members are bootstrapped statically (every member is told every peer's URL), each
with its own data directory (`data_dir/member-<i>`) and ports, and each is an
`EtcdServer` started and stopped by its own PID. `start_etcd` starts one server or a
cluster, whichever `members` asks for. `metrics` reads what a member reports about itself
(the chaos injector asks which member leads).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

from keepstep.errors import ConfigError
from keepstep.launch.etcd_server import (
    EtcdServer,
    EtcdServerError,
    check_settings,
    free_port,
    member_args,
    port_taken,
    scheme,
)

if TYPE_CHECKING:
    from keepstep.launch.etcd_tls import ServerTLS

MEMBER_COUNTS = (1, 3)  # an even count tolerates no more losses than the odd one below it
_PORT_ATTEMPTS = 5


class RunningEtcd(Protocol):
    """What the launcher needs of its etcd: where it is, and how to end it."""

    @property
    def endpoint(self) -> str: ...

    def stop(self, timeout: float = 10.0) -> None: ...


class EtcdCluster:
    """The members of one etcd cluster; `endpoint` lists their client addresses."""

    def __init__(self, members: tuple[EtcdServer, ...]) -> None:
        self.members = members
        self.endpoint = ",".join(m.endpoint for m in members)

    @classmethod
    def start(
        cls,
        binary: str,
        data_dir: Path,
        *,
        members: int = 3,
        host: str = "127.0.0.1",
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        timeout: float = 20.0,
        tls: ServerTLS | None = None,
    ) -> EtcdCluster:
        """Start every member and return once each answers /health (a quorum formed and
        a leader was elected); on any failure every member started is killed."""
        check_settings(binary, heartbeat_ms, election_ms, timeout)
        if members < 1:
            raise ConfigError(f"members={members} must be >= 1")
        for attempt in range(_PORT_ATTEMPTS):
            width = 2 if tls is None else 3  # client, peer (and metrics, beside TLS)
            ports = [tuple(free_port(host) for _ in range(width)) for _ in range(members)]
            if len({p for trio in ports for p in trio}) < width * members:
                continue  # the kernel handed the same free port out twice
            names = [f"keepstep-{i}" for i in range(members)]
            initial = ",".join(
                f"{name}={scheme(tls)}://{host}:{trio[1]}"
                for name, trio in zip(names, ports, strict=True)
            )
            servers = []
            for i, (name, trio) in enumerate(zip(names, ports, strict=True)):
                client, peer = trio[0], trio[1]
                mport = trio[2] if tls is not None else None
                member_dir = data_dir / f"member-{i}"
                member_dir.mkdir(parents=True, exist_ok=True)
                args = member_args(
                    name,
                    member_dir,
                    host,
                    client,
                    peer,
                    initial,
                    heartbeat_ms=heartbeat_ms,
                    election_ms=election_ms,
                    tls=tls,
                    metrics_port=mport,
                )
                metrics_at = None if mport is None else f"{host}:{mport}"
                server = EtcdServer(binary, member_dir, args, f"{host}:{client}", metrics_at)
                servers.append(server)
            cluster = cls(tuple(servers))
            try:
                cluster._launch(timeout)
                return cluster
            except EtcdServerError as err:
                if attempt + 1 < _PORT_ATTEMPTS and port_taken(err):
                    continue  # a probed port was taken before etcd bound it: new ports
                raise
        raise EtcdServerError(f"no {2 * members} distinct free ports on {host}")

    def _launch(self, timeout: float) -> None:
        # All at once: a member waits for a quorum of its peers before it is healthy.
        try:
            for member in self.members:
                member.spawn()
            deadline = time.monotonic() + timeout
            for member in self.members:
                member.wait_healthy(max(deadline - time.monotonic(), 0.1))
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(m.pid for m in self.members)

    def leader(self, timeout: float = 1.0) -> int | None:
        """The index of the member that leads now (None: none says it does)."""
        for i, member in enumerate(self.members):
            if not member.running():
                continue
            seen = metrics(member.metrics_endpoint, timeout)
            if seen is not None and seen.get("etcd_server_is_leader") == 1.0:
                return i
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every member (SIGKILL after `timeout`); returns once all are reaped."""
        for member in self.members:
            member.stop(timeout)

    def kill(self) -> None:
        for member in self.members:
            member.kill()

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_etcd(
    binary: str, data_dir: Path, *, members: int, host: str, tls: ServerTLS | None = None
) -> RunningEtcd:
    """One etcd server (`members` 1: data in `data_dir` itself) or a cluster of them."""
    if members not in MEMBER_COUNTS:
        allowed = ", ".join(map(str, MEMBER_COUNTS))
        raise ConfigError(f"etcd members {members}; allowed: {allowed}")
    if members == 1:
        return EtcdServer.start(binary, data_dir, host=host, tls=tls)
    return EtcdCluster.start(binary, data_dir, members=members, host=host, tls=tls)


def metrics(endpoint: str, timeout: float = 1.0) -> dict[str, float] | None:
    """What the etcd at `endpoint` ("host:port" of its plain-HTTP /metrics: the client
    port, or `EtcdServer.metrics_endpoint` beside TLS) reports, series -> value
    (e.g. "etcd_server_is_leader"); None if it does not answer within `timeout`."""
    # Loopback must never go through an HTTP proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://{endpoint}/metrics", timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            try:
                out[series] = float(value)
            except ValueError:
                continue
    return out
