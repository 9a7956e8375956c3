"""What a running local cluster is made of, as `e2e/cluster` records it in state.json.

Where it sits: `cluster.up` writes a ClusterState after every process it starts (so that
`down` can stop a half-started cluster too); `down` and `status` read it back. Nothing else
is needed to find the cluster again: PIDs with their start times, the URLs, the paths.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from keepstep.e2e.procs import ProcessRecord

STATE_FILE = "state.json"
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LOOPBACK = re.compile(r"^127\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})$")


class ClusterError(RuntimeError):
    """`e2e/cluster` cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class NodeSpec:
    """One process-backed node: its Node name and its loopback address."""

    name: str
    ip: str

    def __post_init__(self) -> None:
        if not _NODE_NAME.match(self.name):
            raise ValueError(f"node name {self.name!r} must be a DNS label (a-z, 0-9, '-')")
        match = _LOOPBACK.match(self.ip)
        if not match or not all(0 <= int(part) <= 255 for part in match.groups()):
            raise ValueError(f"node ip {self.ip!r} must be a loopback address 127.X.Y.Z")


def node_specs(count: int) -> tuple[NodeSpec, ...]:
    """node-1 .. node-N on 127.0.2.1 .. 127.0.2.N (out of the way of 127.0.0.1 and of the
    127.0.1.1 that many systems map their own host name to)."""
    if not 1 <= count <= 254:
        raise ValueError(f"--nodes {count}: a local cluster has 1..254 nodes")
    return tuple(NodeSpec(f"node-{i}", f"127.0.2.{i}") for i in range(1, count + 1))


@dataclass(frozen=True)
class ClusterState:
    work_dir: Path
    kubeconfig: Path
    server: str  # the API server, https://127.0.0.1:PORT
    bin_dir: Path
    jobs_etcd: str = ""  # client URL of the training jobs' etcd, once it runs
    nodes: tuple[NodeSpec, ...] = ()
    processes: tuple[ProcessRecord, ...] = field(default=())

    def with_process(self, record: ProcessRecord) -> ClusterState:
        return replace(self, processes=(*self.processes, record))

    def save(self) -> None:
        """Write state.json atomically: a reader never sees half a file."""
        data = {
            "work_dir": str(self.work_dir),
            "kubeconfig": str(self.kubeconfig),
            "server": self.server,
            "bin_dir": str(self.bin_dir),
            "jobs_etcd": self.jobs_etcd,
            "nodes": [{"name": n.name, "ip": n.ip} for n in self.nodes],
            "processes": [p.to_json() for p in self.processes],
        }
        path = self.work_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, work_dir: Path) -> ClusterState | None:
        """The state recorded in `work_dir`, or None if no cluster was ever started there."""
        path = work_dir / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise ClusterError(f"cannot read {path}: {err}") from err
        try:
            return cls(
                work_dir=Path(data["work_dir"]),
                kubeconfig=Path(data["kubeconfig"]),
                server=str(data["server"]),
                bin_dir=Path(data["bin_dir"]),
                jobs_etcd=str(data.get("jobs_etcd", "")),
                nodes=tuple(NodeSpec(n["name"], n["ip"]) for n in data.get("nodes", [])),
                processes=tuple(ProcessRecord.from_json(p) for p in data.get("processes", [])),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ClusterError(f"{path} is not a cluster state file: {err}") from err
