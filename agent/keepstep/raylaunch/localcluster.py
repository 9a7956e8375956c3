"""A Ray cluster on this machine: a head that holds no agent, and one raylet per node.

Where it sits: `chaos_target.RayTarget` starts one when a scenario's first run needs it,
`resize`s it before each run (exactly the raylets the job starts on), hands the Ray
launcher `replace` and `add` for the faults that remove or add a Ray node, and `stop`s it
at the end, which reports any process of it still there. Each raylet has one
`keepstep-node` resource, so the job's agents land one per raylet (the launcher's
`--ray-resource keepstep-node`); the head has no CPU and no such resource. The processes
are started by `ray.cluster_utils.Cluster`; this process is the driver that joins it,
and starts and removes raylets from its main thread (Ray sets a signal handler there).

A removed raylet takes every process on it along (its actors, their keepers' agents and
workers). `replace` then has a fresh one started, as a cluster's autoscaler replaces a lost
machine, so that the launcher's replacement actor has a node to go to. What is this
cluster's is found from its nodes' processes and what runs below them, never by name
alone: another Ray on the machine is not touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from keepstep.errors import KeepstepError

NODE_RESOURCE = "keepstep-node"  # one per raylet: one agent per raylet
NODES_TIMEOUT_S = 60.0  # raylets added or removed are seen by Ray within this
STOP_TIMEOUT_S = 30.0  # the cluster's processes are gone within this after `stop`
ACTOR_MARKER = "ray::NodeActor"  # how Ray names a node actor's process


class LocalRayCluster:
    """Started at construction, and this process connected to it as the driver."""

    def __init__(self) -> None:
        if ray.is_initialized():
            raise KeepstepError("this process is already connected to a Ray cluster")
        with _own_sigterm():
            self.cluster = Cluster(
                initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
            )
        head = self.cluster.head_node
        assert head is not None
        self.session: str = Path(head.get_session_dir_path()).name
        self.address: str = self.cluster.address
        self.raylets: dict[str, Any] = {}  # Ray node id -> its node (cluster_utils)
        try:
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        except BaseException:
            self.cluster.shutdown()
            raise

    def add(self) -> None:
        """Start one more raylet (it is alive in Ray's view when this returns)."""
        with _own_sigterm():
            node = self.cluster.add_node(num_cpus=1, resources={NODE_RESOURCE: 1})
        self.raylets[node.node_id] = node

    def remove(self, node_id: str) -> None:
        """Remove a raylet and every process on it at once (a Ray node lost): its workers
        first (the actors' processes, which would notice a stopped raylet only seconds
        later), then the raylet and the node's other processes."""
        node = self.raylets.pop(node_id, None)
        if node is None:
            raise KeepstepError(f"Ray node {node_id[:12]} is not a raylet of this cluster")
        for info in node.all_processes.get("raylet", []):
            for pid in descendants(info.process.pid):
                _kill(pid)
        self.cluster.remove_node(node)

    def replace(self, node_id: str) -> Callable[[], None]:
        """Remove a raylet now; returns how to start a fresh one in its place (the machine
        replaced), which the launcher does once the job goes on."""
        self.remove(node_id)
        return self.add

    def resize(self, count: int) -> None:
        """Exactly `count` raylets, each seen alive by Ray (those removed seen gone)."""
        while len(self.raylets) > count:
            self.remove(next(reversed(self.raylets)))
        while len(self.raylets) < count:
            self.add()
        try:
            self.cluster.wait_for_nodes(timeout=NODES_TIMEOUT_S)
        except TimeoutError as error:
            raise KeepstepError(f"the local Ray cluster did not settle: {error}") from None

    def actors_left(self, timeout: float) -> list[int]:
        """This cluster's node actor processes still there after `timeout` (a run's end
        kills them)."""
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(set(processes_with(ACTOR_MARKER)) & set(self._below_nodes()))
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)

    def _below_nodes(self) -> list[int]:
        """Every process below one of this cluster's nodes (Ray's workers and actors)."""
        nodes = [self.cluster.head_node, *self.raylets.values()]
        roots = [
            info.process.pid
            for node in nodes
            if node is not None
            for infos in node.all_processes.values()
            for info in infos
        ]
        return [pid for root in roots for pid in [root, *descendants(root)]]

    def stop(self) -> list[str]:
        """Disconnect and stop every process of the cluster; returns those still there after
        STOP_TIMEOUT_S (each also killed)."""
        mine = set(self._below_nodes())
        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()  # type: ignore[no-untyped-call]
        self.raylets.clear()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := self._processes(mine)) and time.monotonic() < deadline:
            time.sleep(0.2)
        out = []
        for pid in left:
            out.append(f"Ray process {pid}: {command_line(pid)[:120]}")
            _kill(pid)
        return out

    def _processes(self, mine: set[int]) -> list[int]:
        """This cluster's processes still alive: those it had when stopped, and any that
        names its session (GCS, raylets, their agents)."""
        named = set(processes_with(self.session))
        return sorted(named | {pid for pid in mine if _pid_alive(pid)})


@contextlib.contextmanager
def _own_sigterm() -> Iterator[None]:
    """Keep this process's SIGTERM handler: each node Ray starts here installs its own,
    which would end only that node's processes and exit (the caller's handler unwinds,
    so that the launcher and `stop` end everything). From the main thread only."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None:  # None: not set from Python, nothing to put back
            signal.signal(signal.SIGTERM, previous)


def processes_with(marker: str) -> list[int]:
    """Live processes (not this one) whose command line holds `marker`."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() and _alive(entry):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (its children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo += children.get(child, [])
    return out


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _pid_alive(pid: int) -> bool:
    try:
        return _alive(Path(f"/proc/{pid}"))
    except (OSError, ValueError):
        return False


def _alive(entry: Path) -> bool:
    stat = (entry / "stat").read_text()
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
