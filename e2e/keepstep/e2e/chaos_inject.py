"""The chaos injector of cluster mode: a scenario's faults applied to a TrainJob's cluster.

Where it sits: `ClusterTarget.run` (chaos_cluster.py) starts one beside each TrainJob. It
is the local injector (`keepstep.chaos.inject.Injector`: when a fault is due, by
step, time or detection, read from the agents' event logs) with the cluster's actions:

    kill-node         the node runner hosting the pod crashes as a whole (`kill`): its pod
                      processes get SIGKILL, its heartbeats stop, the Node goes NotReady,
                      and the operator replaces the pod on another node
    hang-node         every pod process of that node stopped (`hang`); with `duration` it
                      resumes, else it is killed once the other agents have ended
                      (a killed node's shared-memory snapshots are removed: its memory
                      is gone, as a real node's would be); `method: freezer` freezes the
                      pod's process group in a cgroup, as in local mode
    drain-node        the pod is deleted: the node runner sends SIGTERM, the agent leaves
                      at the next step boundary, the operator replaces the pod
    join-node         `kubectl scale` the TrainJob one node up
    restart-operator  SIGKILL the operator; started again `duration` seconds later (3 s)
    kill-worker, slow-node, corrupt-snapshot
                      as in local mode, on the pod's processes (they run on this machine)

Scenario node N is the job's pod `<job>-node-N`; records name the pod.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from keepstep.chaos.inject import Injector
from keepstep.chaos.model import Fault, FaultKind
from keepstep.e2e.chaos_env import ChaosCluster
from keepstep.e2e.noderunner import NodeRunner

OPERATOR_DOWN_S = 3.0  # restart-operator without a duration
_AS_LOCAL = (FaultKind.KILL_WORKER, FaultKind.SLOW_NODE, FaultKind.CORRUPT_SNAPSHOT)


class HungNode:
    """A node runner whose pods are stopped: `end` resumes them, `kill` ends them (and
    `on_kill` then drops what the node held in memory)."""

    def __init__(self, runner: NodeRunner, on_kill: Callable[[], object]) -> None:
        self.runner = runner
        self.on_kill = on_kill
        self._ended = False

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.runner.resume()

    def kill(self) -> None:
        for pid in self.runner.pids().values():
            try:
                os.killpg(pid, signal.SIGKILL)  # each pod is its own process group
            except OSError:
                pass
        self.end()  # a stopped process gets its SIGKILL once it runs again
        self.on_kill()


class OperatorDown:
    """The operator killed; `end` starts it again (once)."""

    def __init__(self, cluster: ChaosCluster) -> None:
        self.cluster = cluster
        self._lock = threading.Lock()
        self._ended = False

    def end(self) -> None:
        with self._lock:
            if not self._ended:
                self._ended = True
                self.cluster.operator.start()


class ClusterInjector(Injector):
    def __init__(
        self,
        run_dir: Path,
        cluster: ChaosCluster,
        job: str,
        nodes: int,
        faults: tuple[tuple[int, Fault], ...],
        skip: dict[FaultKind, str],
        poll_s: float = 0.05,
    ) -> None:
        """`run_dir`: the agents' run directory; `job`: the TrainJob's name; `nodes`: its
        numNodes (each join scales it one up)."""
        super().__init__(run_dir, None, faults, skip, poll_s)
        self.cluster = cluster
        self.job = job
        self.nodes = nodes
        self.key = f"{cluster.namespace}.{job}"

    def node_name(self, index: int) -> str:
        return f"{self.job}-node-{index}"

    def snapshot_path(self, node: str) -> Path | None:
        # A pod's agent keeps its snapshots in /dev/shm under the job's key.
        return Path("/dev/shm") / f"keepstep-{self.key}-{node}-0"

    def _act(self, fault: Fault, node: str | None, detail: dict[str, Any]) -> str | None:
        kind = fault.kind
        if kind is FaultKind.RESTART_OPERATOR:
            return self._restart_operator(fault, detail)
        if kind is FaultKind.JOIN_NODE:
            self.nodes += 1
            self.cluster.kubectl("scale", f"trainjob/{self.job}", f"--replicas={self.nodes}")
            detail["replicas"] = self.nodes
            return None
        if node is None:
            return f"{kind.value} needs a node"
        if kind in _AS_LOCAL or (kind is FaultKind.HANG_NODE and fault.method == "freezer"):
            return super()._act(fault, node, detail)
        runner = self.cluster.runner_of(self.job, node)
        if runner is None:
            return f"pod {node} is not bound to a node"
        detail["k8s_node"] = runner.name
        if kind is FaultKind.KILL_NODE:
            self.cluster.killed.add(runner.name)
            runner.kill()
            detail["snapshots_lost"] = self.memory_lost(node)
        elif kind is FaultKind.DRAIN_NODE:
            self.cluster.kubectl("delete", "pod", node, "--wait=false")
        elif kind is FaultKind.HANG_NODE:
            self.cluster.hung.add(runner.name)
            runner.hang()
            hung = HungNode(runner, lambda: self.memory_lost(node))
            detail["method"] = "signal"
            with self._lock:
                if fault.duration is not None:
                    self._ongoing.append((time.time() + fault.duration, hung))
                    detail["resume_after_s"] = fault.duration
                else:
                    self._hung[node] = hung
        else:
            return f"{kind.value} cannot be applied in cluster mode"
        return None

    def memory_lost(self, pod: str) -> int:
        """Remove the shared-memory snapshots of a pod whose node crashed. A real node's
        memory goes with it (a pod's /dev/shm is its own); a process-backed node's pods
        share this machine's, where nothing else would remove them."""
        lost = sorted(Path("/dev/shm").glob(f"keepstep-{self.key}-{pod}-*"))
        for path in lost:
            path.unlink(missing_ok=True)
        return len(lost)

    def _restart_operator(self, fault: Fault, detail: dict[str, Any]) -> str | None:
        if not self.cluster.operator.running:
            return "the operator is not running"
        down = fault.duration if fault.duration is not None else OPERATOR_DOWN_S
        detail["exit_code"] = self.cluster.operator.kill()
        detail["down_s"] = down
        with self._lock:
            self._ongoing.append((time.time() + down, OperatorDown(self.cluster)))
        return None
