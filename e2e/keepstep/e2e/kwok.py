"""kwok: simulated nodes for scale tests, run against the local control plane.

Where it sits: scale tests and bench/operator_scale.py start one `Kwok` next to a
`ControlPlane`, then create fake Node objects (`kwok_nodes`). kwok plays the kubelet of
every node carrying the annotation `kwok.x-k8s.io/node=<manage>`: it marks the node
Ready, renews its Lease, and moves the pods the real scheduler binds there to Running
(and finishes their deletion). No process runs for a pod, so thousands of nodes fit on one
machine.

kwok v0.8 has no built-in stages: it runs with the stages kwokctl uses by default, which
e2e/controlplane/build ships as `<bin>/stage/default.yaml`. It listens only for its health
check (`/healthz` on a free loopback port), which tells when it runs. Started and stopped
by PID (keepstep.e2e.procs), like every other process of the test cluster.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from keepstep.e2e import procs
from keepstep.e2e.controlplane import build_binaries
from keepstep.e2e.procs import ProcessRecord

ANNOTATION = "kwok.x-k8s.io/node"
STAGES = Path("stage") / "default.yaml"
_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")

Popen = subprocess.Popen[bytes]


@dataclass(frozen=True)
class KwokConfig:
    """What one kwok process manages and how.

    manage: the annotation value of the nodes it plays (`kwok.x-k8s.io/node=<manage>`);
        two kwok processes on one control plane need different values.
    lease_duration_s: the nodes' Lease duration; kwok renews every quarter of it, which
        must stay below the controller-manager's --node-monitor-grace-period.
    cidr: where pod IPs come from when a node has no spec.podCIDR (the kwok default, a
        /24, runs out after 254 pods).
    """

    kubeconfig: Path
    work_dir: Path
    manage: str = "fake"
    lease_duration_s: int = 20
    cidr: str = "10.240.0.1/16"

    def __post_init__(self) -> None:
        if not _VALUE.match(self.manage) or len(self.manage) > 63:
            raise ValueError(
                f"manage={self.manage!r} must be a label value (letters, digits, '-', '_', "
                "'.', at most 63 characters)"
            )
        if not 4 <= self.lease_duration_s <= 3600:
            raise ValueError(f"lease_duration_s={self.lease_duration_s} must be 4..3600 seconds")
        try:
            ipaddress.ip_interface(self.cidr)
        except ValueError:
            raise ValueError(
                f"cidr={self.cidr!r} must be an address/prefix such as 10.240.0.1/16"
            ) from None

    def argv(self, binary: Path, stages: Path, port: int) -> list[str]:
        return [
            str(binary),
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={ANNOTATION}={self.manage}",
            f"--node-lease-duration-seconds={self.lease_duration_s}",
            f"--cidr={self.cidr}",
            f"--config={stages}",
            f"--server-address=127.0.0.1:{port}",
        ]


def _healthy(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as response:
            return bytes(response.read()).strip() == b"ok"
    except OSError:
        return False


class Kwok:
    """A running kwok process; `stop()` ends it (also when the object is collected)."""

    def __init__(self, config: KwokConfig, record: ProcessRecord, popen: Popen, port: int) -> None:
        self.config = config
        self.record = record
        self.port = port
        self._popens = {record.pid: popen}
        self._finalizer = weakref.finalize(self, _stop_quietly, record, self._popens)

    @classmethod
    def start(
        cls, config: KwokConfig, *, bin_dir: Path | None = None, timeout: float = 60.0
    ) -> Kwok:
        """Start kwok (log: work_dir/kwok.log) and wait until its health check answers.
        Raises StartupError with the log tail if it exits or stays silent for `timeout`."""
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
        bin_dir = bin_dir or build_binaries()
        binary, stages = bin_dir / "kwok", bin_dir / STAGES
        for path in (binary, stages):
            if not path.exists():
                raise procs.StartupError("kwok", f"{path} is missing: run e2e/controlplane/build")
        config.work_dir.mkdir(parents=True, exist_ok=True)
        record, popen, (port,) = procs.start_on_free_ports(
            "kwok",
            lambda p: config.argv(binary, stages, p[0]),
            1,
            config.work_dir / "kwok.log",
            ready=lambda p: _healthy(p[0]),
            deadline=time.monotonic() + timeout,
            what="kwok /healthz",
        )
        return cls(config, record, popen, port)

    @property
    def pid(self) -> int:
        return self.record.pid

    def running(self) -> bool:
        return self._popens[self.record.pid].poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; a second call does nothing."""
        procs.stop([self.record], timeout=timeout, popens=self._popens)
        self._finalizer.detach()


def _stop_quietly(record: ProcessRecord, popens: dict[int, Popen]) -> None:
    try:
        procs.stop([record], timeout=5.0, popens=popens)
    except procs.ProcessError:
        pass  # best effort at interpreter exit
