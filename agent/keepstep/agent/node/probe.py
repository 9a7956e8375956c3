"""Liveness probes between node agents.

Each agent answers on a TCP port with its node's status (which workers are ready to
train). After a failed collective the survivors probe every member node in parallel:
a killed node refuses the connection at once, a hung one (SIGSTOP: the kernel still
accepts, nobody answers) misses the deadline, a live one says which workers it offers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProbeResult:
    node: str
    alive: bool
    ready: tuple[str, ...] = ()
    detail: str = ""
    seconds: float = 0.0
    timed_out: bool = False  # it accepted (or did not refuse) but did not answer in time


class ProbeServer:
    """Answers each connection with one JSON line from `status()` and closes it."""

    def __init__(self, status: Callable[[], dict[str, Any]], host: str = "127.0.0.1") -> None:
        self.status = status
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall((json.dumps(self.status()) + "\n").encode())
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


def probe(node: str, host: str, port: int, timeout: float) -> ProbeResult:
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(max(timeout - (time.perf_counter() - start), 0.01))
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        return ProbeResult(
            node,
            False,
            detail=f"no answer within {timeout:g} s (hung?)",
            seconds=time.perf_counter() - start,
            timed_out=True,
        )
    except OSError as error:
        return ProbeResult(
            node,
            False,
            detail=f"unreachable: {error.strerror or error}",
            seconds=time.perf_counter() - start,
        )
    try:
        status = json.loads(data)
    except ValueError:
        return ProbeResult(
            node, False, detail="garbled answer", seconds=time.perf_counter() - start
        )
    return ProbeResult(
        node, True, tuple(status.get("ready", ())), seconds=time.perf_counter() - start
    )


def probe_all(targets: Mapping[str, tuple[str, int]], timeout: float) -> dict[str, ProbeResult]:
    """Probe every node in parallel; the whole call takes at most about `timeout`."""
    if not targets:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        futures = {
            node: pool.submit(probe, node, host, port, timeout)
            for node, (host, port) in targets.items()
        }
        return {node: f.result() for node, f in futures.items()}
