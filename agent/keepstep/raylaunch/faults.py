"""Step-gated faults through Ray: kill a node's actor or its worker, remove or add a Ray node.

Where it sits: `launcher.RayLauncher` arms a step gate per fault step before any agent
starts (`keepstep.launch.gates`, as `keepstep run --fault` does); the agents hold the job
at that boundary, the launcher's loop calls `on_held`, the fault is injected with exactly
its step committed, and the gate is released once it has landed (a killed actor: once Ray
reports it dead, its process gone, so its keeper has ended the node's agent and workers).
`on_progress` fires the faults of a gate the job passed unheld, late, as the local injector
does. A worker is killed by its node's actor (the pid is the one the agent published in
etcd, and must belong to that node's process group). Removing and adding a Ray node are
the caller's (`RemoveNode`, `AddNode`: a local cluster's raylets); what takes time and is
no part of the fault (starting a raylet) is done once the gate is released. Once a node is
added the launcher's growth decision places an agent on it, and `grown` names that node.

A record per injected fault goes to the run's fault log with the local launcher's fields:
a killed actor or removed Ray node is "kill-node" (the agent and its workers end by
SIGKILL; the summary's recovery fold and exit-status rules treat it so), a killed worker
"kill-worker", an added Ray node "join-node"; `ray` says how it was done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore
from keepstep.agent.protocol import NodeRecord
from keepstep.launch.faults import FaultKind
from keepstep.launch.gates import Claimed, GateClient
from keepstep.raylaunch.config import RayFault, RayFaultKind
from keepstep.raylaunch.nodes import NodeSlot, SlotState

GATE_OWNER = "ray"  # gates named ray-step-<K>
# A killed actor is seen gone within this (the job stays held at the step meanwhile).
GONE_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 10.0  # an actor asked to kill its worker; etcd asked for the node's record

# How a REMOVE_NODE fault removes a Ray node, given its id (a test's local cluster); it
# may return what to do once the job goes on (a local cluster starts a fresh raylet).
RemoveNode = Callable[[str], Callable[[], None] | None]
# How an ADD_NODE fault adds a Ray node that can hold one bundle of the job (done once the
# job goes on: it does not wait at its step for a machine to start).
AddNode = Callable[[], None]
_RECORDED = {
    RayFaultKind.KILL_ACTOR: FaultKind.KILL_NODE,
    RayFaultKind.REMOVE_NODE: FaultKind.KILL_NODE,
    RayFaultKind.KILL_WORKER: FaultKind.KILL_WORKER,
    RayFaultKind.ADD_NODE: FaultKind.JOIN_NODE,
}


class RayFaultInjector:
    def __init__(
        self,
        faults: Sequence[RayFault],
        slots: Mapping[str, NodeSlot],
        remove_node: RemoveNode | None,
        note: Callable[[str], None],
        add_node: AddNode | None = None,
    ) -> None:
        self.pending = sorted(faults, key=lambda f: f.step)
        self.slots, self.remove_node, self.note = slots, remove_node, note
        self.add_node = add_node
        self.log: list[dict[str, Any]] = []
        self.gates: GateClient | None = None
        self.kv: KVStore | None = None
        self.job = ""
        self._later: list[Callable[[], None]] = []  # done once the gate is released

    @property
    def wake(self) -> threading.Event | None:
        return self.gates.wake if self.gates is not None else None

    def arm(self, kv: KVStore, job: str) -> None:
        self.kv, self.job = kv, job
        if not self.pending:
            return
        gates = GateClient(kv, job, GATE_OWNER)
        try:
            gates.arm((f"step-{s}", s) for s in sorted({f.step for f in self.pending}))
        except KVError as error:
            self.note(f"step gates not armed ({error}): faults land when their step is seen")
            gates.close()
            return
        self.gates = gates

    def close(self) -> None:
        if self.gates is not None:
            self.gates.close()

    def killed(self) -> set[str]:
        """The nodes a fault ended whole (its actor killed, its Ray node removed)."""
        kind = FaultKind.KILL_NODE.value
        return {str(f["node"]) for f in self.log if f["kind"] == kind}

    def grown(self, node: str) -> None:
        """The launcher placed `node` on a Ray node it found free: the oldest added Ray node
        not yet taken is its (the fold matches a join to the node its epoch admits)."""
        for entry in self.log:
            if entry["ray"] == RayFaultKind.ADD_NODE.value and entry["node"] is None:
                entry["node"] = node
                return

    def on_held(self) -> None:
        if self.gates is not None:
            for claimed in self.gates.ready():
                self._fire(claimed)

    def on_progress(self, step: int) -> None:
        if self.gates is not None:
            for claimed in self.gates.passed(step):
                self._fire(claimed)
            return
        for due in sorted({f.step for f in self.pending if f.step <= step}):
            self._inject_step(Claimed(f"step-{due}", due, step, held=False))
        self._run_later()

    def _fire(self, claimed: Claimed) -> None:
        assert self.gates is not None
        try:
            self._inject_step(claimed)
        finally:
            self.gates.release(claimed)
        self._run_later()

    def _run_later(self) -> None:
        later, self._later = self._later, []
        for work in later:
            work()

    def _inject_step(self, claimed: Claimed) -> None:
        due = [f for f in self.pending if f.step == claimed.step]
        self.pending = [f for f in self.pending if f.step != claimed.step]
        for fault in due:
            self._inject(fault, claimed)

    def _inject(self, fault: RayFault, at: Claimed) -> None:
        node = None if fault.node is None else f"n{fault.node}"
        slot = self.slots.get(node) if node is not None else None
        if node is not None and (slot is None or slot.state is not SlotState.RUNNING):
            self.note(f"fault {fault} skipped: node {node} is not running")
            return
        t = time.time()  # before the act: recovery is timed from the fault
        skipped = self._act(fault, slot)
        if skipped is not None:
            self.note(f"fault {fault} skipped: {skipped}")
            return
        self.log.append(
            {
                "kind": _RECORDED[fault.kind].value,
                "ray": fault.kind.value,
                "node": node,
                "ray_node": slot.ray_node if slot is not None else None,
                "step": at.actual,
                "scheduled_step": fault.step,
                "held": at.held,
                "held_by": at.holder,
                "spec": str(fault),
                "t": t,
            }
        )
        late = "" if at.actual == fault.step else f" (late: scheduled at {fault.step})"
        where = f" on {node}" if node is not None else ""
        self.note(f"fault {fault} injected at step {at.actual}{where}{late}")

    def _act(self, fault: RayFault, slot: NodeSlot | None) -> str | None:
        """Inject one fault; returns why it could not be, or None."""
        if fault.kind is RayFaultKind.ADD_NODE:
            if self.add_node is None:
                return "no way to add a Ray node was given"
            self._later.append(self.add_node)
            return None
        assert slot is not None
        if fault.kind is RayFaultKind.KILL_ACTOR:
            # SIGKILL in the actor's own process: `ray.kill` lets the process linger after
            # Ray reports it dead, and the node's keeper acts only when the process is gone.
            slot.actor.crash.remote()
            if not _gone(slot.actor, GONE_TIMEOUT_S):
                ray.kill(slot.actor, no_restart=True)
                self.note(f"fault {fault}: the actor of {slot.name} still answers")
        elif fault.kind is RayFaultKind.KILL_WORKER:
            return self._kill_worker(slot)
        elif self.remove_node is None:
            return "no way to remove a Ray node was given"
        else:
            then = self.remove_node(slot.ray_node)
            if then is not None:
                self._later.append(then)
        return None

    def _kill_worker(self, slot: NodeSlot) -> str | None:
        """SIGKILL the node's first worker, through its actor (on the worker's Ray node)."""
        record = self._node_record(slot.name)
        pid = record.workers.get(protocol.member_id(slot.name, 0)) if record else None
        if pid is None:
            return f"node {slot.name} has no worker now"
        try:
            killed = ray.get(slot.actor.kill_worker.remote(pid), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayError as error:  # GetTimeoutError included
            return f"its actor did not answer ({type(error).__name__})"
        return None if killed else f"worker {pid} is not a live process of {slot.name}"

    def _node_record(self, node: str) -> NodeRecord | None:
        if self.kv is None:
            return None
        try:
            item = self.kv.get(protocol.key(self.job, "nodes", node), CALL_TIMEOUT_S)
        except KVError:
            return None
        return None if item is None else protocol.decode(NodeRecord, item.value)


def _gone(actor: Any, timeout: float) -> bool:
    """Whether Ray reports `actor` dead within `timeout` (its process has exited, so its
    keeper has seen the pipe close and ended the node's processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.poll.remote(), timeout=max(deadline - time.monotonic(), 0.01))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.02)
    return False
