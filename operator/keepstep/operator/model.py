"""What one reconcile observes: a TrainJob, its pods, its agents — parsed and validated.

Where it sits: `kube` and `agents` read raw objects; this module turns them into frozen
values (`Job`, `PodView`, `AgentView`) that `decide` takes as its snapshot. Nothing here
does I/O. A TrainJob whose spec can never work raises `SpecError` naming the field.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from keepstep.agent.protocol import DoneRecord, EpochRecord, NodeRecord, ProgressRecord
from keepstep.operator.errors import SpecError
from keepstep.operator.spec import JobSpec

GROUP = "keepstep.dev"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
KIND = "TrainJob"
JOB_LABEL = f"{GROUP}/job"
INDEX_LABEL = f"{GROUP}/node-index"
# The job's name names its headless Service (a DNS-1035 label) and prefixes its pods'
# names, <name>-node-<index>, which must stay DNS labels of at most 63 characters.
NAME_MAX = 50
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class Phase(StrEnum):
    """A TrainJob's lifecycle. Pending -> Running -> Succeeded | Failed; Suspended from
    Pending or Running and back to Pending; Succeeded and Failed are final."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def final(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)

    @classmethod
    def parse(cls, raw: object) -> Phase | None:
        """The phase a status holds, or None for a missing or foreign value."""
        return cls(raw) if isinstance(raw, str) and raw in cls.__members__.values() else None


class PodPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"


def parse_time(text: str | None) -> float | None:
    """An RFC 3339 timestamp from the API ("2025-01-02T03:04:05Z") as epoch seconds."""
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def format_time(seconds: float) -> str:
    """Epoch seconds as the API writes timestamps (UTC, whole seconds)."""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class JobRef:
    """A TrainJob's identity: what events and status patches address."""

    name: str
    namespace: str
    uid: str

    @property
    def key(self) -> str:
        """The job's name in etcd and in the agents' KEEPSTEP_JOB: "<namespace>.<name>"."""
        return f"{self.namespace}.{self.name}"

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> JobRef:
        meta = obj.get("metadata") or {}
        return cls(
            str(meta["name"]), str(meta.get("namespace") or "default"), str(meta.get("uid") or "")
        )


@dataclass(frozen=True)
class Job:
    """One observed TrainJob: identity, parsed spec and the status as last written."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: JobSpec
    status: Mapping[str, Any] = field(default_factory=dict)
    deleting: bool = False

    @property
    def ref(self) -> JobRef:
        return JobRef(self.name, self.namespace, self.uid)

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def phase(self) -> Phase | None:
        return Phase.parse(self.status.get("phase"))

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> Job:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        name = str(meta["name"])
        if len(name) > NAME_MAX or not _NAME.match(name):
            raise SpecError(
                f"metadata.name={name!r} must be a DNS label of at most {NAME_MAX} characters "
                "(a letter first, then lowercase letters, digits and '-'): it names the job's "
                "Service and prefixes its pods' names"
            )
        return cls(
            name=name,
            namespace=str(meta.get("namespace") or "default"),
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
            spec=JobSpec.from_dict(obj.get("spec") or {}),
            status=dict(status) if isinstance(status, Mapping) else {},
            deleting=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class PodView:
    """One pod of a job as the reconcile needs it."""

    name: str
    index: int
    phase: PodPhase
    terminating: bool = False  # deletionTimestamp set: on its way out, never counted live
    running_since: float | None = None  # when its container started (None: not running)
    # False for a pod with the job's label but another owner (an earlier job of the same
    # name, not yet garbage-collected): it only keeps its name from being reused.
    owned: bool = True
    node: str = ""  # spec.nodeName: where the scheduler bound it ("" while unbound)
    created_at: float | None = None  # metadata.creationTimestamp (None: not listed yet)
    # Why a Pending pod does not run: its container's waiting reason (ImagePullBackOff,
    # CreateContainerConfigError, ...) or the scheduler's (Unschedulable), and the message.
    waiting: str = ""
    waiting_message: str = ""
    ended: str = ""  # how its container ended: "Error, exit code 1"
    status_reason: str = ""  # status.reason: Evicted, NodeLost, ... (the node's doing)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any], job_uid: str) -> PodView | None:
        """The view of a pod with the job's label, or None if it has no node index."""
        meta = obj.get("metadata") or {}
        owners = meta.get("ownerReferences") or []
        owned = any(o.get("uid") == job_uid and o.get("kind") == KIND for o in owners)
        labels = meta.get("labels") or {}
        try:
            index = int(labels.get(INDEX_LABEL, ""))
        except ValueError:
            return None
        status = obj.get("status") or {}
        raw_phase = status.get("phase") or "Pending"
        phase = PodPhase(raw_phase) if raw_phase in PodPhase.__members__.values() else None
        running_since = None
        waiting, waiting_message, ended = "", "", ""
        for cs in status.get("containerStatuses") or []:
            state = cs.get("state") or {}
            started = (state.get("running") or {}).get("startedAt")
            if started:
                running_since = parse_time(started)
            if state.get("waiting"):
                waiting = str(state["waiting"].get("reason") or "Waiting")
                waiting_message = str(state["waiting"].get("message") or "")
            if state.get("terminated"):
                end = state["terminated"]
                ended = f"{end.get('reason') or 'Terminated'}, exit code {end.get('exitCode')}"
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and not waiting:
                waiting = str(cond.get("reason") or "Unschedulable")
                waiting_message = str(cond.get("message") or "")
        if phase is PodPhase.RUNNING and running_since is None:
            running_since = parse_time(status.get("startTime"))
        return cls(
            name=str(meta["name"]),
            index=index,
            phase=phase or PodPhase.UNKNOWN,
            terminating=bool(meta.get("deletionTimestamp")),
            running_since=running_since,
            owned=owned,
            node=str((obj.get("spec") or {}).get("nodeName") or ""),
            created_at=parse_time(meta.get("creationTimestamp")),
            waiting=waiting,
            waiting_message=waiting_message,
            ended=ended,
            status_reason=str(status.get("reason") or ""),
        )


def pod_summary(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a pod `PodView.from_object` reads: what the operator keeps of each pod
    in its cache (a full pod is ~3 KB of JSON; a 1000-node job has 1000 of them)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [
                {"kind": o.get("kind"), "uid": o.get("uid")}
                for o in meta.get("ownerReferences") or []
            ],
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "creationTimestamp": meta.get("creationTimestamp"),
        },
        "spec": {"nodeName": (obj.get("spec") or {}).get("nodeName")},
        "status": {
            "phase": status.get("phase"),
            "reason": status.get("reason"),
            "startTime": status.get("startTime"),
            "conditions": [
                {k: c.get(k) for k in ("type", "status", "reason", "message")}
                for c in status.get("conditions") or []
                if c.get("type") == "PodScheduled"
            ],
            "containerStatuses": [
                {"state": dict(cs.get("state") or {})}
                for cs in status.get("containerStatuses") or []
            ],
        },
    }


@dataclass(frozen=True)
class Recovery:
    """What one member reported entering epoch `epoch` (mttr_s when it was measured)."""

    epoch: int
    member: str
    mttr_s: float | None = None


@dataclass(frozen=True)
class AgentView:
    """A job's records in etcd (see keepstep.agent.protocol), plus when each node's
    record was last seen by this operator (for the lost-pod grace)."""

    owner_uid: str | None = None  # the TrainJob uid the operator stamped on the prefix
    nodes: Mapping[str, NodeRecord] = field(default_factory=dict)
    epoch: EpochRecord | None = None
    progress: Mapping[str, ProgressRecord] = field(default_factory=dict)
    recoveries: tuple[Recovery, ...] = ()
    done: Mapping[str, DoneRecord] = field(default_factory=dict)
    last_seen: Mapping[str, float] = field(default_factory=dict)
    records: int = 0  # keys under the prefix other than the operator's own

    def complete(self) -> bool:
        """Every worker of the current epoch reported done (done keys are per member or
        per node, depending on the agent)."""
        if self.epoch is None or not self.epoch.members:
            return False
        names = {d.node for d in self.done.values()}
        return all(m in names or m.rpartition("/")[0] in names for m in self.epoch.members)
