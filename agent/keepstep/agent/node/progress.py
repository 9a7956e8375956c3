"""Publishing a node's progress to etcd, off the training path.

Workers tell their agent about every commit; the agent keeps the newest figures and a
background thread writes them (at most every `MIN_INTERVAL_S`) for the launcher's progress
line and fault schedule, and for the operator's status.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from keepstep.agent import protocol
from keepstep.agent.kv import KVError, KVStore

log = logging.getLogger(__name__)

# Every put is a raft write in etcd: one put per commit per node takes CPU from the
# training on a small machine. The node leading the epoch (its first member) publishes at
# most every MIN_INTERVAL_S: readers take the job's step and rate from the newest record,
# so the launcher still injects a step-scheduled fault within a few steps of its step.
# The others, whose records only bound the oldest snapshot, publish every FOLLOWER_INTERVAL_S.
MIN_INTERVAL_S = 0.2
FOLLOWER_INTERVAL_S = 2.0


class ProgressPublisher:
    def __init__(self, kv: KVStore, key: str, node: str, global_batch: int, timeout: float) -> None:
        self.kv, self.key, self.node = kv, key, node
        self.global_batch, self.timeout = global_batch, timeout
        self._lock = threading.Lock()
        self._due = threading.Event()
        self._stop = threading.Event()
        self._times: list[tuple[float, int]] = []
        self.latest: protocol.ProgressRecord | None = None
        self._written: protocol.ProgressRecord | None = None  # guarded by _write_lock
        self._write_lock = threading.Lock()
        self._fault: tuple[float, int] | None = None  # (when, epoch) of an open recovery
        self._last_mttr: float | None = None
        self._leads = True  # whether this node hosts the first member of the newest epoch

    def fault(self, epoch: int) -> None:
        """A fault was detected in `epoch`: the next commit in a later epoch ends its MTTR
        as this node saw it (from its detection; the run summary measures from the fault).

        The end is the fold's (`protocol.recovery`: the first commit after the failed
        epoch), but the fold itself is not run here. It builds a recovery around the
        `epoch-agreed` event, which only the agreeing node writes, and starts it at a
        `fault-detected` event, which a node does not write when a worker reports a
        failure of an epoch already replaced: every node still needs its own figure (its
        members publish it with their recovery records, and the operator takes the
        slowest). This runs on every commit, so it stays two numbers, not a fold."""
        with self._lock:
            if self._fault is None or self._fault[1] != epoch:
                self._fault = (time.time(), epoch)

    def start(self) -> None:
        threading.Thread(target=self._run, name="progress", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def flush(self) -> None:
        """Write the newest figures now if the background thread has not yet: a worker's
        last commit must be in etcd before its finish is, or the job ends with its status
        a step short."""
        self._write()

    def record(
        self, commit: dict[str, Any], leads: bool = True, snapshot_bytes: int = 0
    ) -> float | None:
        """Note a commit (`leads`: this node hosts the epoch's first member; `snapshot_bytes`:
        what the node's snapshot files hold now); samples/s is over the last 20 commits.
        Returns the MTTR of the recovery this commit ends, if any."""
        closed: float | None = None
        now, step = time.time(), int(commit["step"])
        with self._lock:
            self._times = [*self._times[-19:], (now, step)]
            first_t, first_step = self._times[0]
            rate = (step - first_step) / (now - first_t) if now > first_t else 0.0
            if self._fault is not None and int(commit["epoch"]) > self._fault[1]:
                self._last_mttr, self._fault = now - self._fault[0], None
                closed = self._last_mttr
            self._leads = leads
            self.latest = protocol.ProgressRecord(
                self.node,
                step + 1,
                int(commit["epoch"]),
                int(commit["world_size"]),
                rate * self.global_batch,
                self._last_mttr,
                now,
                snapshot_bytes,
            )
        self._due.set()
        return closed

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._due.wait(0.5):
                continue
            self._due.clear()
            self._write()
            self._stop.wait(MIN_INTERVAL_S)
            if not self._leads:
                # A follower waits out the rest of its longer interval, unless it becomes
                # the leader (a new epoch) or stops.
                deadline = time.monotonic() + FOLLOWER_INTERVAL_S - MIN_INTERVAL_S
                while not (self._leads or self._stop.is_set()) and time.monotonic() < deadline:
                    self._stop.wait(min(MIN_INTERVAL_S, deadline - time.monotonic()))

    def _write(self) -> None:
        with self._write_lock:
            with self._lock:
                record = self.latest
            if record is None or record is self._written:
                return
            try:
                self.kv.put(self.key, protocol.encode(record), self.timeout)
            except KVError as error:
                log.warning("progress not published: %s", error)
                return
            self._written = record
