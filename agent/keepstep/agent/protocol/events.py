"""The node's event log: one JSON object per line, with wall-clock times, and its schema.

Agents append what happened (commits, detections, agreed epochs, recoveries) to
`events-<node>.jsonl` in the run directory; the run summary, the dashboard, the chaos
harness and telemetry read it, and `protocol.recovery` folds it into recovery records.
Wall-clock time is used because events of several processes are put on one timeline.

Every event is `{"t": <wall-clock seconds>, "kind": <EventKind value>, ...fields}`. The
kinds and the fields each carries are listed on `EventKind`, the one place they are
written down. Kind values are the strings the log has always held, so old logs still
read; a reader meets kinds it does not know (a newer writer) and skips them, which is why
readers compare `event["kind"]` with the enum (a `str`) rather than convert it.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Event = Mapping[str, Any]


class EventKind(enum.StrEnum):
    """What an event says happened, and the fields it carries besides `t` and `kind`.

    The node agent:
        agent-started        node, pid, store (host:port of the store it hosts)
        spare-ready          node, pid (a warm spare process waits for a worker's place)
        lease-lost           node (its leased record vanished: it registers again)
        drain-requested      node (SIGTERM: it leaves at the next step boundary)
        worker-started       member, pid, warm (taken from the spare pool)
        worker-ready         member (imported and built its model: it can be admitted)
        worker-exited        member, pid, code, finished (its finish was recorded first)
        worker-abnormal-exit member, pid, code, exit (described), reason (what follows)
        fault-detected       cause (collective | worker-exit | heartbeat-missed |
                             lease-expired), node (where the fault was seen), epoch (the
                             epoch that failed), reason;
                             optional fault_t (when the fault itself happened, if known)
        finish               member, done (steps trained), params_sha256
        resumed              member, step (seeded from a durable checkpoint)
        checkpoint-submitted step, url
        gate-held            gate, step (the gate's), done (steps committed: the step it
                             held at), member (the worker that reached it first)
        gate-expired         gates, done, member, alone (false: this agent expired the gate
                             in etcd, nobody claimed it; true: still closed after twice the
                             bound, the agent let its worker go on alone)
    The healer (the agent whose proposal won the compare-and-set):
        epoch-agreed         epoch, members, reason, store, timeout_scale (the epoch's
                             timeouts x their defaults; absent before it existed: 1);
                             after the first epoch also
                             admitted and removed (members; absent in logs written before
                             they existed: the reason names them, "admit a,b; drain c"),
                             planned (a step-boundary change, not a failure), step (the
                             step the epoch starts at), agree_s (failures: probe + CAS),
                             checkpoint_step (a fallback: every member resumes from the
                             durable checkpoint of that step, a double fault having lost
                             sharded state with every holder)
        excluded             member, epoch (an epoch left the member out: it waits again)
    A worker, relayed by its agent with `member` added:
        reconfigured         epoch, members, communicator_s, restore_s, replan_s,
                             resume_step, rolled_back_steps, received_state,
                             reshard_s, reshard_bytes
                             (`keepstep.elastic.control.Reconfiguration`)
        commit               step, epoch, world_size, micro_batches, samples, step_s,
                             assignment, snapshot_s, skipped, metrics, compute_s,
                             new_weights (`keepstep.elastic.control.CommitRecord`)
    The agent hosting the step's first member, once per change (`protocol.weights`):
        weights-changed      member (whose commit said it), epoch, step (the new weights
                             apply from step + 1), old, new (member -> weight), counts
                             (member -> micro-batches at step, under the old weights)
    The agent of a member found too slow (`node/slow_drain`), once per request:
        drain-slow           member, node, epoch, step, ratio (its speed / the median),
                             drained (false: refused), reason
    """

    AGENT_STARTED = "agent-started"
    SPARE_READY = "spare-ready"
    LEASE_LOST = "lease-lost"
    DRAIN_REQUESTED = "drain-requested"
    WORKER_STARTED = "worker-started"
    WORKER_READY = "worker-ready"
    WORKER_EXITED = "worker-exited"
    WORKER_ABNORMAL_EXIT = "worker-abnormal-exit"
    FAULT_DETECTED = "fault-detected"
    FINISH = "finish"
    RESUMED = "resumed"
    CHECKPOINT_SUBMITTED = "checkpoint-submitted"
    GATE_HELD = "gate-held"
    GATE_EXPIRED = "gate-expired"
    EPOCH_AGREED = "epoch-agreed"
    EXCLUDED = "excluded"
    RECONFIGURED = "reconfigured"
    COMMIT = "commit"
    WEIGHTS_CHANGED = "weights-changed"
    DRAIN_SLOW = "drain-slow"


def kind_of(event: Event) -> EventKind | None:
    """The event's kind, or None for a kind this reader does not know (a newer writer)."""
    kind = event.get("kind")
    try:
        return EventKind(kind) if isinstance(kind, str) else None
    except ValueError:
        return None


class EventLog:
    """Appends events; `listener` (telemetry) sees each one as the dict that was written."""

    def __init__(
        self, path: Path, listener: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.path = path
        self.listener = listener
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)

    def write(self, kind: EventKind, **fields: Any) -> None:
        # EventKind(...) also refuses a misspelt kind from a caller that passed a string.
        event = {"t": time.time(), "kind": EventKind(kind).value, **fields}
        line = json.dumps(event)
        with self._lock:
            self._file.write(line + "\n")
        if self.listener is not None:
            self.listener(event)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every node's events, ordered by time."""
    events: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    events.sort(key=lambda e: e["t"])
    return events
