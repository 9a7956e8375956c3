"""What a process-backed node does about one pod: the record it keeps and its decisions.

Where it sits: `noderunner.NodeRunner` keeps a `LocalPod` per pod it runs (its process,
when it started and ended, signals sent) next to the pod as the API server last showed it.
On every pod event and on a short timer it calls `decide(pod, local, now)` and applies the
returned actions; `podstatus` turns the same record into the pod status it reports. Pure:
the same snapshot and `now` always give the same answer.

A pod's life on the node:

    bound ──START──► running ──exit──► ended ──(restartPolicy allows, after back-off)──► START
                        │                └──(Never, or OnFailure with exit 0)──► Succeeded/Failed
    deletionTimestamp   └──TERMINATE (SIGTERM)──grace──► KILL (SIGKILL) ──exit──► FINALIZE
    object gone ──► KILL, then FORGET once the process has exited

A pod the API server says was running but whose process this runner does not have (the
runner was restarted) is MARK_LOST: it ended with exit code 137, reason
ContainerStatusUnknown, as the kubelet reports a container that vanished with its node.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from keepstep.e2e.podproc import Pod

DEFAULT_GRACE_S = 30.0  # the API's default terminationGracePeriodSeconds
BACKOFF_BASE_S = 1.0  # the kubelet starts at 10 s; tests cannot wait that long
BACKOFF_MAX_S = 30.0
LOST_EXIT_CODE = 137


class RestartPolicy(enum.Enum):
    ALWAYS = "Always"
    ON_FAILURE = "OnFailure"
    NEVER = "Never"

    @classmethod
    def of(cls, pod: Pod) -> RestartPolicy:
        return cls(pod.get("spec", {}).get("restartPolicy") or "Always")


class Act(enum.Enum):
    START = "start"  # run the container's process (again, after a back-off)
    MARK_LOST = "mark-lost"  # the API says it ran, but no process of ours does
    TERMINATE = "terminate"  # SIGTERM the process group: the pod is being deleted
    KILL = "kill"  # SIGKILL the process group: grace is over, or the pod is gone
    FINALIZE = "finalize"  # delete the pod object with grace 0: its process has exited
    FORGET = "forget"  # drop the local record: the pod and its process are both gone


@dataclass(frozen=True)
class Decision:
    actions: tuple[Act, ...]
    reason: str


@dataclass(frozen=True)
class Termination:
    """How one run of the container ended."""

    exit_code: int
    reason: str  # Completed, Error, StartError, CreateContainerConfigError, ...
    finished_at: datetime
    finished_mono: float  # monotonic clock, for the restart back-off
    started_at: datetime | None = None  # None: the process never started
    message: str = ""


@dataclass(frozen=True)
class LocalPod:
    """What the runner knows about the process of one pod."""

    uid: str
    namespace: str
    name: str
    seen_at: datetime  # when the runner took the pod on (startTime, Initialized)
    restarts: int = 0
    pid: int | None = None
    started_at: datetime | None = None
    ended: Termination | None = None  # the current run's end; None while it runs
    last: Termination | None = None  # the run before the current one
    retry: bool = True  # False after a spec error: running it again cannot help
    term_sent_at: float | None = None  # monotonic time of the SIGTERM
    kill_sent: bool = False

    @property
    def running(self) -> bool:
        return self.pid is not None and self.ended is None

    def with_start(self, pid: int, at: datetime) -> LocalPod:
        """A (re)started process; a restart moves the previous end to `last`."""
        again = self.ended is not None
        return LocalPod(
            self.uid,
            self.namespace,
            self.name,
            self.seen_at,
            restarts=self.restarts + (1 if again else 0),
            pid=pid,
            started_at=at,
            last=self.ended if again else self.last,
        )

    def with_end(self, end: Termination, *, retry: bool = True) -> LocalPod:
        return LocalPod(
            self.uid,
            self.namespace,
            self.name,
            self.seen_at,
            restarts=self.restarts,
            pid=self.pid,
            started_at=self.started_at,
            ended=end,
            last=self.last,
            retry=retry,
            term_sent_at=self.term_sent_at,
            kill_sent=self.kill_sent,
        )


def backoff_s(restarts: int) -> float:
    return float(min(BACKOFF_BASE_S * 2**restarts, BACKOFF_MAX_S))


def is_terminal(local: LocalPod, policy: RestartPolicy) -> bool:
    """True once the pod's process ended for good: it will not be started again."""
    end = local.ended
    if end is None:
        return False
    return (
        not local.retry
        or policy is RestartPolicy.NEVER
        or (policy is RestartPolicy.ON_FAILURE and end.exit_code == 0)
    )


def grace_s(pod: Pod) -> float:
    """Seconds between SIGTERM and SIGKILL: the deletion's grace, else the pod's own."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    for value in (
        meta.get("deletionGracePeriodSeconds"),
        spec.get("terminationGracePeriodSeconds"),
    ):
        if value is not None:
            return float(value)
    return DEFAULT_GRACE_S


def decide(pod: Pod | None, local: LocalPod | None, now: float, *, can_start: bool) -> Decision:
    """What to do about one pod: `pod` as the API server shows it (None once it is gone),
    `local` what the runner has (None before it took the pod on), `now` the monotonic
    clock. `can_start` is False while the node is hung or stopping."""
    if pod is None:
        if local is None:
            return Decision((), "neither a pod nor a process")
        if local.running:
            return Decision((Act.KILL,), "the pod object is gone; its process must not outlive it")
        return Decision((Act.FORGET,), "the pod object is gone and its process has exited")
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return _decide_deleting(pod, local, now)
    phase = pod.get("status", {}).get("phase")
    if local is None:
        if phase in ("Succeeded", "Failed"):
            return Decision((), f"the pod already {phase}")
        if _reported_running(pod):
            return Decision(
                (Act.MARK_LOST,), "the API says it runs but this runner has no process for it"
            )
        if not can_start:
            return Decision((), "bound, but the node does not start pods now")
        return Decision((Act.START,), "bound to this node and not started yet")
    if local.running:
        return Decision((), f"running as pid {local.pid}")
    end = local.ended
    if end is None:
        return Decision((), "taken on, no process yet")
    policy = RestartPolicy.of(pod)
    if is_terminal(local, policy):
        return Decision((), f"ended with exit code {end.exit_code} (restartPolicy {policy.value})")
    wait = end.finished_mono + backoff_s(local.restarts) - now
    if wait > 0:
        return Decision((), f"restart back-off: {wait:.1f} s left")
    if not can_start:
        return Decision((), "due for a restart, but the node does not start pods now")
    return Decision(
        (Act.START,), f"exit code {end.exit_code} and restartPolicy {policy.value}: restart"
    )


def _decide_deleting(pod: Pod, local: LocalPod | None, now: float) -> Decision:
    if local is None or not local.running:
        return Decision((Act.FINALIZE,), "deleted and no process runs: remove the object")
    if local.term_sent_at is None:
        return Decision((Act.TERMINATE,), f"deleted: SIGTERM pid {local.pid}")
    grace = grace_s(pod)
    if now - local.term_sent_at >= grace:
        if local.kill_sent:
            return Decision((), f"SIGKILL sent to pid {local.pid}; waiting for it to exit")
        return Decision((Act.KILL,), f"still running {grace:g} s after SIGTERM: SIGKILL")
    left = local.term_sent_at + grace - now
    return Decision((), f"SIGTERM sent to pid {local.pid}; {left:.1f} s of grace left")


def _reported_running(pod: Pod) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return any("running" in (s.get("state") or {}) for s in statuses)
