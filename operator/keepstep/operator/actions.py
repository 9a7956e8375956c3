"""The actions a reconcile decision asks for, the decision itself, and what applying it met.

Where it sits: `decide` returns a `Decision`; `kube.Kube.apply` (API objects) and
`agents.AgentStore` (etcd keys) carry the actions out, in the order given, and `Applied`
says what the API server refused (`refusal.after_refusal` takes it). Actions are plain
frozen values, so tests compare them directly; each one is idempotent when applied again
(creating an existing object or deleting a missing one is not an error).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class DeleteCause(StrEnum):
    """Why a pod is deleted (the operator's metrics count deletions by it)."""

    LOST = "lost"  # failed, exited unfinished, stuck Pending, or its agent vanished
    SCALE_DOWN = "scale_down"
    SUSPENDED = "suspended"  # the job is suspended, or its suspended run ends
    JOB_FAILED = "job_failed"


@dataclass(frozen=True)
class ClaimPrefix:
    """Stamp the job's etcd prefix with its uid; `reset` first deletes every key under it
    (records of an earlier job with the same name, or of a run before a suspension)."""

    job_key: str
    uid: str
    reset: bool = False


@dataclass(frozen=True)
class EnsureService:
    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class EnsureNetworkPolicy:
    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class CreatePod:
    index: int
    manifest: Mapping[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    name: str
    why: str  # in words, for the event and the log
    cause: DeleteCause
    grace_seconds: int | None = None  # None: the pod's own; 0 for pods on a dead node


@dataclass(frozen=True)
class PatchStatus:
    """A JSON merge patch of the status subresource (None values delete a field)."""

    patch: Mapping[str, Any]


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


Action = (
    ClaimPrefix | EnsureNetworkPolicy | EnsureService | CreatePod | DeletePod | PatchStatus | Event
)


@dataclass(frozen=True)
class Decision:
    """What to do, and why in words (tests assert on `reason`)."""

    actions: tuple[Action, ...] = ()
    reason: str = ""
    status: Mapping[str, Any] = field(default_factory=dict)  # the status after the actions

    def of(self, kind: type[Action]) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def writes(self) -> int:
        """How many API or etcd writes applying this decision takes (one per action)."""
        return len(self.actions)


@dataclass(frozen=True)
class Refusal:
    """The API server refused to create a pod: its HTTP status, the Status object's reason
    (Forbidden, Invalid, ...) and message (the quota or Pod Security rule it broke)."""

    pod: str
    code: int
    reason: str
    message: str


@dataclass(frozen=True)
class Applied:
    """What applying actions met: the TrainJob's resourceVersion after a status patch (if
    there was one) and the pod creations the API server refused."""

    version: str | None = None
    refused: tuple[Refusal, ...] = ()
