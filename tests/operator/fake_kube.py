"""An in-memory API server for the operator's unit tests: one namespace's TrainJobs, pods,
Services, NetworkPolicies and events, with the writes applied as the real one would (a
status patch is a JSON merge patch) and, when told to, pod creations refused as a quota or
Pod Security would refuse them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from keepstep.operator.actions import (
    Action,
    Applied,
    CreatePod,
    DeletePod,
    EnsureNetworkPolicy,
    EnsureService,
    Event,
    PatchStatus,
    Refusal,
)
from keepstep.operator.kube import Tally
from keepstep.operator.model import JobRef

QUOTA = (
    403,
    "Forbidden",
    'pods "{pod}" is forbidden: exceeded quota: zero, requested: pods=1, used: pods=0, '
    "limited: pods=0",
)


class FakeKube:
    """Holds one namespace's TrainJobs, pods and services as the API server would."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.services: set[str] = set()
        self.policies: dict[str, dict[str, Any]] = {}
        self.events: list[Event] = []
        self.version = 0
        self.create_attempts = 0
        # (code, reason, message with {pod}): every pod creation is refused with it
        self.refuse: tuple[int, str, str] | None = None

    def _count(self, tally: Tally | None, kind: str, write: bool) -> None:
        if tally is not None:
            tally.add(kind, write)

    def get_job(self, namespace: str, name: str, tally: Tally | None = None) -> Any:
        self._count(tally, "get_job", False)
        return copy.deepcopy(self.jobs.get(name))

    def list_pods(self, namespace: str, job_name: str, tally: Tally | None = None) -> list[Any]:
        self._count(tally, "list_pods", False)
        return [
            p for p in self.pods.values() if p["metadata"]["labels"]["keepstep.dev/job"] == job_name
        ]

    def service_exists(self, namespace: str, name: str, tally: Tally | None = None) -> bool:
        self._count(tally, "get_service", False)
        return name in self.services

    def network_policy_exists(self, namespace: str, name: str, tally: Tally | None = None) -> bool:
        self._count(tally, "get_network_policy", False)
        return name in self.policies

    def apply(self, job: JobRef, actions: Sequence[Action], tally: Tally | None = None) -> Applied:
        version = None
        refused: list[Refusal] = []
        for a in actions:
            self._count(tally, type(a).__name__, True)
            if isinstance(a, CreatePod):
                self.create_attempts += 1
                if self.refuse is not None:
                    code, reason, message = self.refuse
                    refused.append(Refusal(a.name, code, reason, message.format(pod=a.name)))
                    continue
                self.pods.setdefault(a.name, copy.deepcopy(dict(a.manifest)))
            elif isinstance(a, DeletePod):
                self.pods.pop(a.name, None)
            elif isinstance(a, EnsureService):
                self.services.add(a.manifest["metadata"]["name"])
            elif isinstance(a, EnsureNetworkPolicy):
                self.policies.setdefault(a.manifest["metadata"]["name"], dict(a.manifest))
            elif isinstance(a, Event):
                self.events.append(a)
            elif isinstance(a, PatchStatus):
                obj = self.jobs[job.name]
                merged = {**obj.get("status", {}), **a.patch}
                obj["status"] = {k: v for k, v in merged.items() if v is not None}
                self.version += 1
                version = str(self.version)
        return Applied(version, tuple(refused))
