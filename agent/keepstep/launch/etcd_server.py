"""A private etcd server on loopback.

Where it sits: integration tests, chaos runs and a one-machine `keepstep run` start their
own etcd through `EtcdServer.start`; everything else reaches it through
`keepstep.agent.kv.etcd.EtcdKV(server.endpoint)`. The server runs with a fast heartbeat
(50 ms) and election timeout (500 ms) because etcd's shortest lease is derived from the
election timeout (ceil(1.5 x election) seconds): with the defaults (1 s) a 1 s lease would
silently become 2 s, and failure detection would be slower than keepstep promises.

`etcd_cluster.EtcdCluster` starts several of these as the members of one cluster; the
flags every member gets are `member_args`.

Which binary to run (and the lowest etcd version that works) is `etcd_binary`'s
business; `find_etcd` is importable from here too.

With `tls` (`etcd_tls.ServerTLS`) the client and peer ports speak TLS and require client
certificates; /health and /metrics then move to a third, plain-HTTP port on the same host
(`metrics_endpoint`), which the start-up check and the chaos harness read.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from keepstep.errors import ConfigError, KeepstepError
from keepstep.launch.etcd_binary import find_etcd as find_etcd
from keepstep.launch.etcd_binary import is_executable, too_old

if TYPE_CHECKING:
    from keepstep.launch.etcd_tls import ServerTLS

_PORT_ATTEMPTS = 5
ETCD_GOMAXPROCS = 1  # see `EtcdServer.spawn`
# etcd < 3.5 will not start on arm64 unless this names the architecture; it sets nothing else.
_PASSED_ETCD_ENV = ("ETCD_UNSUPPORTED_ARCH",)


class EtcdServerError(KeepstepError):
    """The etcd server did not start (or exited); the message carries its log tail."""


class EtcdServer:
    """One etcd process; data in `data_dir/data`, its output in `data_dir/etcd.log`."""

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        args: list[str],
        endpoint: str,
        metrics_endpoint: str | None = None,
    ) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.log_path = data_dir / "etcd.log"
        self.endpoint = endpoint  # "host:port", what EtcdKV takes
        # "host:port" of /health and /metrics over plain HTTP (the client port without TLS).
        self.metrics_endpoint = metrics_endpoint or endpoint
        self._args = args
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(
        cls,
        binary: str,
        data_dir: Path,
        *,
        name: str = "keepstep",
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        timeout: float = 20.0,
        tls: ServerTLS | None = None,
    ) -> EtcdServer:
        """Start etcd and return once it answers /health; ports 0 pick free ones. With
        `tls`, TLS with client certificates on both ports (see the module docstring)."""
        check_settings(binary, heartbeat_ms, election_ms, timeout)
        for port, what in ((client_port, "client_port"), (peer_port, "peer_port")):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{what}={port} must be 0 (pick a free port) or 1..65535")
        data_dir.mkdir(parents=True, exist_ok=True)
        attempts = _PORT_ATTEMPTS if client_port == 0 or peer_port == 0 else 1
        for attempt in range(attempts):
            cport = client_port or free_port(host)
            pport = peer_port or free_port(host)
            mport = free_port(host) if tls is not None else None
            peer_url = f"{scheme(tls)}://{host}:{pport}"
            args = member_args(
                name,
                data_dir,
                host,
                cport,
                pport,
                f"{name}={peer_url}",
                heartbeat_ms=heartbeat_ms,
                election_ms=election_ms,
                tls=tls,
                metrics_port=mport,
            )
            metrics = None if mport is None else f"{host}:{mport}"
            server = cls(binary, data_dir, args, f"{host}:{cport}", metrics)
            try:
                server._launch(timeout)
                return server
            except EtcdServerError as err:
                if attempt + 1 < attempts and port_taken(err):
                    continue  # another process took a port between our probe and etcd's bind
                raise
        raise AssertionError("unreachable")

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise EtcdServerError("the etcd server was never started")
        return self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self, timeout: float = 20.0) -> None:
        """Start the stopped (or killed) server again: same ports, same data."""
        if self.running():
            raise EtcdServerError(f"etcd pid {self.pid} is still running; stop or kill it first")
        self._launch(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; returns once the process is reaped."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)  # by PID; a no-op if it was already reaped
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL now (a crash, for chaos tests) and reap; data and ports are kept."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10.0)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _launch(self, timeout: float) -> None:
        self.spawn()
        self.wait_healthy(timeout)

    def spawn(self) -> None:
        """Start the process and return at once (a cluster member cannot be healthy alone)."""
        # ETCD_* variables would configure etcd behind our flags' back.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("ETCD_") or k in _PASSED_ETCD_ENV
        }
        # A private etcd serves a few agents' small requests on a machine whose cores train.
        # With one Go scheduler thread (not one per core) it hands goroutines between threads
        # less: in a 4-node `keepstep run` on 2 cores it used 4.9 ms of CPU a step instead of
        # 9.2, with a third fewer context switches. A GOMAXPROCS from the environment wins.
        env.setdefault("GOMAXPROCS", str(ETCD_GOMAXPROCS))
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                [self.binary, *self._args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C meant for the test runner must not reach it
            )
        self._proc = proc
        # Reap it when this object goes or the interpreter exits, so no etcd outlives a run.
        weakref.finalize(self, _kill_quietly, proc)

    def wait_healthy(self, timeout: float) -> None:
        """Return once the server answers /health; kill it and raise if it does not."""
        proc = self._proc
        if proc is None:
            raise EtcdServerError("the etcd server was never started")
        try:
            self._wait_healthy(proc, timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        url = f"http://{self.metrics_endpoint}/health"
        # Loopback must never go through an HTTP proxy from the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                why = too_old(self.binary)  # an older etcd refuses our flags
                because = "" if why is None else f" ({why})"
                raise EtcdServerError(
                    f"etcd exited with status {proc.returncode} while starting{because}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with opener.open(url, timeout=1.0) as response:
                    if b'"health":"true"' in response.read():
                        return
            except OSError:
                pass  # not listening yet, or no leader yet (503)
            if time.monotonic() >= deadline:
                raise EtcdServerError(
                    f"etcd at {self.endpoint} was not healthy within {timeout} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def member_args(
    name: str,
    data_dir: Path,
    host: str,
    client_port: int,
    peer_port: int,
    initial_cluster: str,
    *,
    heartbeat_ms: int,
    election_ms: int,
    tls: ServerTLS | None = None,
    metrics_port: int | None = None,
) -> list[str]:
    """The flags of one member of a statically bootstrapped cluster (`initial_cluster`:
    "name=http(s)://host:peer,..." of every member); its data goes to `data_dir/data`.
    With `tls` both ports speak TLS and /health, /metrics move to `metrics_port`."""
    if (tls is None) != (metrics_port is None):
        raise ConfigError("a TLS member needs a metrics port, and only a TLS member has one")
    client_url = f"{scheme(tls)}://{host}:{client_port}"
    peer_url = f"{scheme(tls)}://{host}:{peer_port}"
    extra: list[str] = []
    if tls is not None:
        extra = [*tls.args(), f"--listen-metrics-urls=http://{host}:{metrics_port}"]
    return [
        f"--name={name}",
        f"--data-dir={data_dir / 'data'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={initial_cluster}",
        "--initial-cluster-state=new",
        f"--heartbeat-interval={heartbeat_ms}",
        f"--election-timeout={election_ms}",
        # A long-lived local server must not grow without bound; an hour of history
        # is far more than any watch that reconnects needs.
        "--auto-compaction-mode=periodic",
        "--auto-compaction-retention=1h",
        "--logger=zap",  # 3.4's default logger ignores --log-level; 3.5 on only have zap
        "--log-level=warn",
        *extra,
    ]


def scheme(tls: ServerTLS | None) -> str:
    return "http" if tls is None else "https"


def check_settings(binary: str, heartbeat_ms: int, election_ms: int, timeout: float) -> None:
    """Raise ConfigError for settings etcd would refuse (or a start that cannot wait)."""
    if not is_executable(Path(binary)):
        raise ConfigError(f"etcd binary {binary!r} is not an executable file")
    if heartbeat_ms < 1 or election_ms < 5 * heartbeat_ms:
        raise ConfigError(
            f"heartbeat_ms={heartbeat_ms}, election_ms={election_ms}: etcd needs a "
            "heartbeat >= 1 ms and an election timeout >= 5 heartbeats"
        )
    if not timeout > 0:
        raise ConfigError(f"timeout={timeout!r} must be > 0 seconds")


def port_taken(err: EtcdServerError) -> bool:
    """Whether etcd failed because a port we probed as free was taken before it bound."""
    return "address already in use" in str(err)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10.0)
