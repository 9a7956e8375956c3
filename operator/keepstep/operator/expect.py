"""Expectations: the pods a reconcile created or deleted that its pod cache may not show yet.

Where it sits: the operator reads a job's pods from kopf's in-memory index (kept current by
its watch), not from a LIST on every reconcile, so a 1000-pod job costs no 1000-pod read
per event. A watch lags behind our own writes, though: a reconcile that ran right after
creating pod 7 could miss it in the cache and create pod 8 as well. So every create and
delete is remembered here, and `adjust` lays the ones a cache snapshot cannot reflect yet
over that snapshot before `decide` sees it.

When is a create reflected? When the snapshot shows the pod, or when the watch delivered
an event of the pod before the snapshot was taken (the pod may be gone again: created and
deleted before any reconcile saw it). Watch events are numbered by `observe`; `mark` gives
the number a snapshot was taken at, in the same event loop that updates the index, so
events that arrive while a reconcile runs do not count for its older snapshot. A deadline
ends every expectation: a create the API server accepted but whose pod never showed up
must not be masked forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from keepstep.operator.actions import CreatePod, Decision, DeletePod
from keepstep.operator.model import PodPhase, PodView

DEFAULT_TTL_S = 30.0
Ident = tuple[str, str, str]  # (namespace, name, uid) of a TrainJob


@dataclass
class _Created:
    index: int
    until: float
    observed_at: int | None = None  # the number of the first watch event of the pod


@dataclass
class _Pending:
    created: dict[str, _Created] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)  # name -> until


class Expectations:
    """Per job: what we wrote and a pod cache may not show yet (thread-safe)."""

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._lock = threading.Lock()
        self._jobs: dict[Ident, _Pending] = {}
        self._events = 0

    def record(self, job: Ident, decision: Decision) -> None:
        """Remember the decision's creates and deletes: call before applying them (the
        watch may report them before the apply returns); `forget` if the apply fails."""
        until = self.clock() + self.ttl_s
        with self._lock:
            pending = self._jobs.setdefault(job, _Pending())
            for create in decision.of(CreatePod):
                pending.created[create.name] = _Created(create.index, until)
            for delete in decision.of(DeletePod):
                pending.deleted[delete.name] = until
                pending.created.pop(delete.name, None)

    def observe(self, job: Ident, name: str) -> None:
        """The watch delivered an event of pod `name` (after the index took it in)."""
        with self._lock:
            self._events += 1
            pending = self._jobs.get(job)
            created = pending.created.get(name) if pending is not None else None
            if created is not None and created.observed_at is None:
                created.observed_at = self._events

    def mark(self) -> int:
        """The number of watch events observed so far: take it with a cache snapshot."""
        with self._lock:
            return self._events

    def dropped(self, job: Ident, names: Sequence[str]) -> None:
        """The API server refused to create these pods: they will never show up."""
        with self._lock:
            pending = self._jobs.get(job)
            for name in names:
                if pending is not None:
                    pending.created.pop(name, None)

    def forget(self, job: Ident) -> None:
        """Drop what was remembered (an apply failed: what it did is unknown)."""
        with self._lock:
            self._jobs.pop(job, None)

    def adjust(self, job: Ident, pods: Sequence[PodView], mark: int | None = None) -> list[PodView]:
        """The cache snapshot `pods`, taken at `mark` (None: now), with our own writes that
        it cannot reflect laid over it: a created pod is added (Pending), a deleted pod
        still in it counts as terminating."""
        now = self.clock()
        with self._lock:
            mark = self._events if mark is None else mark
            pending = self._jobs.get(job)
            if pending is None:
                return list(pods)
            seen = {p.name for p in pods}
            for name, c in list(pending.created.items()):
                reflected = c.observed_at is not None and c.observed_at <= mark
                if name in seen or reflected or c.until < now:
                    del pending.created[name]
            for name, until in list(pending.deleted.items()):
                if name not in seen or until < now:
                    del pending.deleted[name]
            out = [replace(p, terminating=True) if p.name in pending.deleted else p for p in pods]
            out += [PodView(n, c.index, PodPhase.PENDING) for n, c in pending.created.items()]
            if not pending.created and not pending.deleted:
                del self._jobs[job]
        return out
