"""Step-gated faults through Ray: kill a node's actor, or remove the Ray node it runs on.

Where it sits: `launcher.RayLauncher` arms a step gate per fault step before any agent
starts (`keepstep.launch.gates`, as `keepstep run --fault` does); the agents hold the job
at that boundary, the launcher's loop calls `on_held`, the fault is injected with exactly
its step committed, and the gate is released once Ray reports the actor dead (its
process gone, so its keeper has ended the node's agent and workers). `on_progress` fires
the faults of a gate the job passed unheld, late, as the local injector does.

A record per injected fault goes to the run's fault log with the local launcher's fields;
its `kind` is "kill-node" (the agent and its workers end by SIGKILL, the summary's
recovery fold and exit-status rules treat it so) and `ray` says how it was done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from keepstep.agent.kv import KVError, KVStore
from keepstep.launch.faults import FaultKind
from keepstep.launch.gates import Claimed, GateClient
from keepstep.raylaunch.config import RayFault, RayFaultKind
from keepstep.raylaunch.nodes import NodeSlot, SlotState

GATE_OWNER = "ray"  # gates named ray-step-<K>
# A killed actor is seen gone within this (the job stays held at the step meanwhile).
GONE_TIMEOUT_S = 30.0

# How a REMOVE_NODE fault removes a Ray node, given its id (a test's local cluster).
RemoveNode = Callable[[str], None]


class RayFaultInjector:
    def __init__(
        self,
        faults: Sequence[RayFault],
        slots: Mapping[str, NodeSlot],
        remove_node: RemoveNode | None,
        note: Callable[[str], None],
    ) -> None:
        self.pending = sorted(faults, key=lambda f: f.step)
        self.slots, self.remove_node, self.note = slots, remove_node, note
        self.log: list[dict[str, Any]] = []
        self.gates: GateClient | None = None

    @property
    def wake(self) -> threading.Event | None:
        return self.gates.wake if self.gates is not None else None

    def arm(self, kv: KVStore, job: str) -> None:
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

    def _fire(self, claimed: Claimed) -> None:
        assert self.gates is not None
        try:
            self._inject_step(claimed)
        finally:
            self.gates.release(claimed)

    def _inject_step(self, claimed: Claimed) -> None:
        due = [f for f in self.pending if f.step == claimed.step]
        self.pending = [f for f in self.pending if f.step != claimed.step]
        for fault in due:
            self._inject(fault, claimed)

    def _inject(self, fault: RayFault, at: Claimed) -> None:
        node = f"n{fault.node}"
        slot = self.slots.get(node)
        if slot is None or slot.state is not SlotState.RUNNING:
            self.note(f"fault {fault} skipped: node {node} is not running")
            return
        t = time.time()  # before the act: recovery is timed from the fault
        if fault.kind is RayFaultKind.KILL_ACTOR:
            # SIGKILL in the actor's own process: `ray.kill` lets the process linger after
            # Ray reports it dead, and the node's keeper acts only when the process is gone.
            slot.actor.crash.remote()
            if not _gone(slot.actor, GONE_TIMEOUT_S):
                ray.kill(slot.actor, no_restart=True)
                self.note(f"fault {fault}: the actor of {node} still answers")
        elif self.remove_node is None:
            self.note(f"fault {fault} skipped: no way to remove a Ray node was given")
            return
        else:
            self.remove_node(slot.ray_node)
        self.log.append(
            {
                "kind": FaultKind.KILL_NODE.value,
                "ray": fault.kind.value,
                "node": node,
                "ray_node": slot.ray_node,
                "step": at.actual,
                "scheduled_step": fault.step,
                "held": at.held,
                "spec": str(fault),
                "t": t,
            }
        )
        late = "" if at.actual == fault.step else f" (late: scheduled at {fault.step})"
        self.note(f"fault {fault} injected at step {at.actual} on {node}{late}")


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
