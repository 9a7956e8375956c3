"""Pod failures a job keeps track of: what counts, how long creation backs off, when the
job gives up. Pure functions of the status, the pods and `now`.

Where it sits: `decide` classifies each pod it takes as lost (`classify`), and keeps the
record of recent failures in the status through a `Ledger`; `refusal.after_refusal` adds
the API server's refusals of this reconcile's pod creations. The record lives in the
TrainJob's status, so a restarted operator (level-triggered) picks up where the last one
stopped:

    status.podFailures         the failures of the last failurePolicy.windowSeconds, oldest
                               first: {cause, time, reason, message, pod}
    status.createBackoffUntil  no pod is created before this time

Causes (also the names of the conditions that say so, and the reason of the Failed
condition when the budget is spent):

    PodCreateRefused   the API server refused to create a pod (quota, Pod Security, an
                       invalid pod): one failure per refused attempt
    PodsUnschedulable  a pod stayed Pending longer than failurePolicy.pendingTimeoutSeconds:
                       a container that cannot start (ImagePullBackOff, ErrImagePull,
                       CreateContainerConfigError for a missing Secret) or no node for it;
                       while the job runs with at least minNodes agents, a pod that only
                       waits for a node is reported but not replaced or counted (an
                       elastic job trains without it)
    CrashLoop          a pod whose agent exited before the job finished (not a node's
                       doing: an evicted pod or a lost node does not count)

Creation backs off exponentially: after the n-th failure in the window the next pod is
created backoff_base * 2**(n-1) seconds later (capped), except that the first lost pod is
replaced at once. One failure more than failurePolicy.backoffLimit of one cause within the
window fails the job, with that cause as the reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from keepstep.operator.model import PodPhase, PodView, format_time, parse_time
from keepstep.operator.settings import DecideConfig
from keepstep.operator.spec import FailurePolicy
from keepstep.operator.status import Condition

KEPT = 64  # podFailures entries at most (the CRD's maxItems)
MESSAGE_CHARS = 512
# A pod failed by its node or the control plane, not by its agent.
NODE_REASONS = frozenset({"Evicted", "NodeLost", "NodeShutdown", "Shutdown", "Terminated"})
NODE_ENDS = ("ContainerStatusUnknown",)


class Cause(StrEnum):
    POD_CREATE_REFUSED = "PodCreateRefused"
    PODS_UNSCHEDULABLE = "PodsUnschedulable"
    CRASH_LOOP = "CrashLoop"


@dataclass(frozen=True)
class Failure:
    cause: Cause
    at: float
    reason: str
    message: str = ""
    pod: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"cause": str(self.cause), "time": format_time(self.at), "reason": self.reason}
        if self.message:
            out["message"] = self.message[:MESSAGE_CHARS]
        if self.pod:
            out["pod"] = self.pod
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> Failure | None:
        """An entry of status.podFailures; None for one this operator did not write."""
        if not isinstance(raw, Mapping) or raw.get("cause") not in Cause.__members__.values():
            return None
        try:
            at = parse_time(str(raw.get("time") or ""))
        except ValueError:
            return None
        if at is None:
            return None
        return cls(
            Cause(raw["cause"]),
            at,
            str(raw.get("reason") or ""),
            str(raw.get("message") or ""),
            str(raw.get("pod") or ""),
        )


@dataclass(frozen=True)
class Policy:
    """The failure policy of one job: its spec.failurePolicy over the operator's defaults."""

    pending_s: float
    backoff_limit: int
    window_s: float
    backoff_base_s: float
    backoff_max_s: float

    @classmethod
    def of(cls, spec: FailurePolicy, config: DecideConfig) -> Policy:
        def pick(value: int | None, default: float) -> float:
            return float(value) if value is not None else default

        limit = spec.backoff_limit if spec.backoff_limit is not None else config.backoff_limit
        return cls(
            pick(spec.pending_timeout_s, config.pending_s),
            limit,
            pick(spec.window_s, config.failure_window_s),
            config.backoff_base_s,
            config.backoff_max_s,
        )

    def delay(self, n: int) -> float:
        """Seconds to wait before the next creation after the n-th failure (0 for n <= 0)."""
        if n <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_base_s * 2.0 ** min(n - 1, 62))


def classify(
    pod: PodView, now: float, policy: Policy, *, waits_for_capacity_ok: bool
) -> tuple[str, Failure] | None:
    """Why a pod that cannot work is lost, and the failure it counts as; None if it is not
    one of these (a Running pod's agent is judged elsewhere). `waits_for_capacity_ok`: the
    job trains without this pod, so one that only waits for a node is left to wait."""
    if pod.phase is PodPhase.FAILED:
        if pod.status_reason in NODE_REASONS or pod.ended.startswith(NODE_ENDS):
            return None
        reason = pod.ended or pod.status_reason or "Failed"
        return "pod Failed", Failure(Cause.CRASH_LOOP, now, reason, "pod Failed", pod.name)
    if pod.phase is not PodPhase.PENDING or pod.created_at is None:
        return None
    pending = now - pod.created_at
    if pending <= policy.pending_s:
        return None
    if pod.waiting == "Unschedulable" and waits_for_capacity_ok:
        return None
    reason = pod.waiting or "Pending"
    why = f"Pending for {pending:.0f} s ({reason})"
    message = f"{reason}: {pod.waiting_message}" if pod.waiting_message else reason
    return why, Failure(Cause.PODS_UNSCHEDULABLE, now, reason, message, pod.name)


def crashed(pod: PodView, now: float, why: str) -> Failure:
    """The failure of a pod whose agent exited before the job finished."""
    return Failure(Cause.CRASH_LOOP, now, pod.ended or "Completed", why, pod.name)


@dataclass
class Ledger:
    """The failures of one job in the window, as one decision updates them (local to it)."""

    policy: Policy
    now: float
    entries: list[Failure] = field(default_factory=list)
    backoff_until: float | None = None

    @classmethod
    def of(cls, status: Mapping[str, Any], now: float, policy: Policy) -> Ledger:
        listed = status.get("podFailures")
        parsed = [Failure.from_dict(r) for r in listed] if isinstance(listed, list) else []
        entries = sorted(
            (f for f in parsed if f is not None and now - f.at < policy.window_s),
            key=lambda f: f.at,
        )
        until = parse_time(str(status.get("createBackoffUntil") or "")) or None
        return cls(policy, now, entries, until)

    def count(self, cause: Cause) -> int:
        return sum(1 for f in self.entries if f.cause is cause)

    def add(self, failure: Failure, *, replace_at_once: bool) -> None:
        """Record `failure` and push creation back; `replace_at_once`: the first failure in
        the window does not delay the next creation (a lost pod is replaced at once)."""
        self.entries.append(failure)
        n = len(self.entries) - (1 if replace_at_once else 0)
        delay = self.policy.delay(n)
        if delay > 0:
            self.backoff_until = max(self.backoff_until or 0.0, self.now + delay)

    def backing_off(self) -> float | None:
        """Seconds until pods may be created again, or None when they may be now."""
        if self.backoff_until is None or self.now >= self.backoff_until:
            return None
        return self.backoff_until - self.now

    def spent(self) -> Cause | None:
        """The cause whose failures in the window exceed the budget, if any."""
        for cause in Cause:
            if self.count(cause) > self.policy.backoff_limit:
                return cause
        return None

    def verdict(self, cause: Cause) -> str:
        last = [f for f in self.entries if f.cause is cause][-1]
        return (
            f"{cause}: {self.count(cause)} failures in {self.policy.window_s:g} s, more than "
            f"failurePolicy.backoffLimit {self.policy.backoff_limit}; last: "
            f"{last.pod + ': ' if last.pod else ''}{last.reason}"
            + (f" ({last.message})" if last.message and last.message != last.reason else "")
        )

    def status_fields(self) -> dict[str, Any]:
        """status.podFailures and status.createBackoffUntil (None removes them; a backoff
        that is over is removed)."""
        entries = [f.to_dict() for f in self.entries[-KEPT:]]
        until = self.backoff_until if self.backing_off() is not None else None
        return {
            "podFailures": entries or None,
            "createBackoffUntil": format_time(math.ceil(until)) if until is not None else None,
        }

    def conditions(self, refused: bool, waiting: Sequence[PodView] = ()) -> list[Condition]:
        """One condition per cause: True while failures of it are in the window (or, for
        PodCreateRefused, while the last creation was refused); `waiting`: pods left to
        wait for a node, reported under PodsUnschedulable."""
        out = []
        for cause in Cause:
            mine = [f for f in self.entries if f.cause is cause]
            active = refused if cause is Cause.POD_CREATE_REFUSED else bool(mine)
            if cause is Cause.PODS_UNSCHEDULABLE and waiting and not mine:
                names = ", ".join(p.name for p in waiting[:5])
                first = waiting[0].waiting_message
                message = f"{len(waiting)} pods wait for a node ({names}): {first}"
                out.append(Condition(str(cause), True, waiting[0].waiting, message))
                continue
            if not active or not mine:
                calm = "PodsCreated" if cause is Cause.POD_CREATE_REFUSED else "NoRecentFailures"
                out.append(Condition(str(cause), False, calm, ""))
                continue
            last = mine[-1]
            message = (
                f"{len(mine)} in the last {self.policy.window_s:g} s (the job fails after "
                f"{self.policy.backoff_limit}); last{' ' + last.pod if last.pod else ''}: "
                f"{last.message or last.reason}"
            )
            if self.backing_off() is not None and self.backoff_until is not None:
                # A time, not a countdown: the status must not change while nothing does.
                message += (
                    f"; no pod is created before {format_time(math.ceil(self.backoff_until))}"
                )
            out.append(Condition(str(cause), True, last.reason, message[: MESSAGE_CHARS * 2]))
        return out
