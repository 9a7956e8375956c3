"""Injecting `keepstep run --fault` faults at their step.

Where it sits: the `Launcher` (run.py) starts etcd, hands its faults here, and has them
armed (`arm`) before any node starts: one step gate per step that has faults
(`launch/gates`). The agents hold the job at that step boundary; the launcher's loop,
woken by the gate's watch (`wake`), calls `on_held`, which claims the gate, injects the
step's faults on the processes the launcher started, and releases the gate. So a fault
lands with exactly its step committed, whatever the step time. `on_progress` is the
fallback for a gate the job passed unheld (or, if the gates could not be armed, for every
fault): the fault is injected when the launcher sees the job past its step, late.

A slow-node fault lasts: it starts a `slowdown` (a cgroup's CPU quota, or a SIGSTOP/SIGCONT
duty cycle) that `tick` lifts at its deadline and `lift_all` at the end of the run (or
before a kill or hang lands on the same node, whose stop a duty cycle would undo).

Each injected fault adds a record to `log` (the run's faults.json, and the summary's
`faults`): kind, node, spec, `scheduled_step`, `step` (the steps committed when it
landed: the scheduled one unless it was fired late), `held` (the job stood at the
boundary while it was injected), `held_by` (the node whose agent held it, or None), t; a
slow-node's also `factor`, `duration`, `method`, `cpu_share` (and `cgroup_unavailable`: why
the duty cycle stood in), and `lifted_t` once lifted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore
from keepstep.agent.node.gates import HOLD_TIMEOUT_S
from keepstep.agent.protocol import NodeRecord
from keepstep.launch.cgroups import PREFIX
from keepstep.launch.faults import FaultKind, FaultSpec
from keepstep.launch.gates import Claimed, GateClient
from keepstep.launch.slowdown import Ongoing, Slowdown, slow_down

GATE_OWNER = "run"  # the launcher's gates are named run-step-<K>
NODES_TIMEOUT_S = 2.0  # reading the node records (the workers' pids) for a kill-worker
# For the durable checkpoint due by a held fault's step. Within the agents' hold: they let
# their workers go after HOLD_TIMEOUT_S (a gate being fired gets as long again), and a
# longer wait let the job run on and finish before the faults landed.
CHECKPOINT_WAIT_S = 0.8 * HOLD_TIMEOUT_S


class FaultInjector:
    def __init__(
        self,
        faults: Sequence[FaultSpec],
        nodes: int,
        agents: Mapping[str, subprocess.Popen[bytes]],
        start_node: Callable[[str], None],
        stopped: set[str],
        note: Callable[[str], None],
        published: Callable[[], int] | None = None,
        checkpoint_every: int = 0,
    ) -> None:
        """`agents`: the launcher's node processes (read when a fault lands); `start_node`
        starts a joining node; `stopped` collects the nodes a hang stopped. With durable
        checkpoints every `checkpoint_every` steps, `published` gives the newest published
        checkpoint's step (-1: none), and a held fault waits for the one due by its step."""
        self.pending = sorted(faults, key=lambda f: f.step)
        self.log: list[dict[str, Any]] = []
        self.next_node = nodes
        self.agents, self.start_node, self.stopped, self.note = agents, start_node, stopped, note
        self.published, self.checkpoint_every = published, checkpoint_every
        self.gates: GateClient | None = None
        self.kv: KVStore | None = None
        self.job = ""
        # Slowdowns in force: (node, monotonic deadline or None, action, log record).
        self.slowed: list[tuple[str, float | None, Ongoing, dict[str, Any]]] = []

    @property
    def wake(self) -> threading.Event | None:
        """Set when a gate is held (None: no gates, poll)."""
        return self.gates.wake if self.gates is not None else None

    def next_step(self) -> int | None:
        return self.pending[0].step if self.pending else None

    def arm(self, kv: KVStore, job: str) -> None:
        """Arm a gate per step that has faults; without them (etcd refused), the faults
        are injected when the launcher sees their step, as `on_progress` says."""
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

    def tick(self, now: float | None = None) -> None:
        """Lift every slowdown whose duration is over (`now`: time.monotonic())."""
        now = time.monotonic() if now is None else now
        for entry in [e for e in self.slowed if e[1] is not None and e[1] <= now]:
            self._lift(entry)

    def lift_all(self, node: str | None = None) -> None:
        """Lift every slowdown in force (of `node` only, if given)."""
        for entry in [e for e in self.slowed if node is None or e[0] == node]:
            self._lift(entry)

    def _lift(self, entry: tuple[str, float | None, Ongoing, dict[str, Any]]) -> None:
        self.slowed.remove(entry)
        node, _, action, record = entry
        try:
            action.end()
        except OSError as error:  # a cgroup that would not empty: say so, go on
            self.note(f"slowdown of {node} not lifted cleanly: {error}")
        record["lifted_t"] = time.time()
        self.note(f"slowdown of {node} lifted")

    def on_held(self) -> None:
        """Inject the faults of every gate the agents hold now, and let the job go on."""
        if self.gates is not None:
            for claimed in self.gates.ready():
                self._fire(claimed)

    def on_progress(self, step: int) -> None:
        """The job is seen with `step` steps committed: inject what it passed unheld."""
        if self.gates is not None:
            for claimed in self.gates.passed(step):
                self._fire(claimed)
            return
        for due in sorted({f.step for f in self.pending if f.step <= step}):
            self._inject_step(Claimed(f"step-{due}", due, step, held=False))

    def _fire(self, claimed: Claimed) -> None:
        assert self.gates is not None
        try:
            if claimed.held:
                self._await_checkpoint(claimed.step)
            self._inject_step(claimed)
        finally:
            self.gates.release(claimed)  # also when an injection failed: never hold for good

    def _await_checkpoint(self, step: int) -> None:
        """While the job is held at `step`, wait (at most CHECKPOINT_WAIT_S) until the
        newest durable checkpoint due by then is published: agents write checkpoints in the
        background, and on a loaded machine a fault would otherwise land before it, so that
        which checkpoint a fallback finds would depend on the load."""
        every = self.checkpoint_every
        if self.published is None or every <= 0 or step < every:
            return
        due = step // every * every
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        while self.published() < due:
            if time.monotonic() >= deadline:
                self.note(
                    f"the checkpoint of step {due} was not published within "
                    f"{CHECKPOINT_WAIT_S:g} s: the faults of step {step} land without it"
                )
                return
            time.sleep(0.1)

    def _inject_step(self, claimed: Claimed) -> None:
        faults = [f for f in self.pending if f.step == claimed.step]
        self.pending = [f for f in self.pending if f.step != claimed.step]
        nodes = self._nodes() if any(f.kind is FaultKind.KILL_WORKER for f in faults) else {}
        for fault in faults:
            self._inject(fault, claimed, nodes)

    def _nodes(self) -> dict[str, NodeRecord]:
        """The node records (the workers' pids); empty if etcd does not answer."""
        if self.kv is None:
            return {}
        try:
            items = self.kv.get_prefix(protocol.prefix(self.job, "nodes"), NODES_TIMEOUT_S)
        except KVError:
            return {}
        return {
            item.key.rpartition("/")[2]: protocol.decode(NodeRecord, item.value) for item in items
        }

    def _inject(self, fault: FaultSpec, at: Claimed, nodes: Mapping[str, NodeRecord]) -> None:
        node = f"n{fault.node}" if fault.node is not None else f"n{self.next_node}"
        proc = self.agents.get(node)
        if fault.kind is FaultKind.KILL_WORKER:
            record = nodes.get(node)
            pid = record.workers.get(protocol.member_id(node, 0)) if record else None
            if pid is None:
                self.note(f"fault {fault} skipped: node {node} has no worker now")
                return
            kill(pid, signal.SIGKILL)
        elif proc is None or proc.poll() is not None:
            if fault.kind is not FaultKind.JOIN_NODE:
                self.note(f"fault {fault} skipped: node {node} is not running")
                return
        slowed: Slowdown | None = None
        if fault.kind in (FaultKind.KILL_NODE, FaultKind.HANG_NODE):
            self.lift_all(node)  # a duty cycle's SIGCONT would undo a hang
        if fault.kind is FaultKind.KILL_NODE:
            killpg(proc, signal.SIGKILL)
        elif fault.kind is FaultKind.SLOW_NODE:
            assert proc is not None
            try:
                slowed = self._slow(fault, node, proc.pid)
            except OSError as error:
                self.note(f"fault {fault} skipped: {error}")
                return
        elif fault.kind is FaultKind.HANG_NODE:
            killpg(proc, signal.SIGSTOP)
            self.stopped.add(node)
        elif fault.kind is FaultKind.DRAIN_NODE:
            assert proc is not None
            kill(proc.pid, signal.SIGTERM)
        elif fault.kind is FaultKind.JOIN_NODE:
            self.next_node += 1
            self.start_node(node)
        entry: dict[str, Any] = {
            "kind": fault.kind.value,
            "node": node,
            "step": at.actual,
            "scheduled_step": fault.step,
            "held": at.held,
            "held_by": at.holder,
            "spec": str(fault),
            "t": time.time(),
        }
        if slowed is not None:
            entry.update(factor=fault.factor, duration=fault.duration, **slowed.detail)
            deadline = None if fault.duration is None else time.monotonic() + fault.duration
            self.slowed.append((node, deadline, slowed.action, entry))
        self.log.append(entry)
        late = "" if at.actual == fault.step else f" (late: scheduled at {fault.step})"
        self.note(f"fault {fault} injected at step {at.actual} on {node}{late}")

    def _slow(self, fault: FaultSpec, node: str, pgid: int) -> Slowdown:
        """Start a slow-node fault's slowdown on the node's process group."""
        name = f"{PREFIX}run-{self.job or 'job'}-{node}-{len(self.log)}"
        return slow_down(pgid, fault.share, fault.method, name)


def kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def killpg(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
