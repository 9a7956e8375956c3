"""Builders for the operator's unit tests: TrainJob dicts, pod views, agent views, and a
tiny "cluster" that applies a decision the way the API server and etcd would."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from keepstep.agent.protocol import DoneRecord, EpochRecord, NodeRecord, ProgressRecord
from keepstep.operator.actions import (
    ClaimPrefix,
    CreatePod,
    Decision,
    DeletePod,
    EnsureNetworkPolicy,
    EnsureService,
    PatchStatus,
)
from keepstep.operator.decide import decide
from keepstep.operator.model import AgentView, Job, PodPhase, PodView
from keepstep.operator.settings import DecideConfig

UID = "uid-1"
ETCD = "http://etcd.example:2379"
CONFIG = DecideConfig(ETCD, lost_pod_s=15.0, below_min_s=60.0)
T0 = 1_700_000_000.0
SHA = "ab" * 32


def job_object(
    name: str = "demo",
    *,
    nodes: int = 3,
    min_nodes: int = 2,
    max_nodes: int = 4,
    suspend: bool = False,
    status: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
    **trainer: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "suspend": suspend,
        "trainer": {
            "image": "keepstep:dev",
            "command": ["python", "train.py"],
            "args": ["--lr", "0.1"],
            "numNodes": nodes,
            "numProcPerNode": 1,
            "numSteps": 100,
            "seed": 7,
            **trainer,
        },
        "elasticPolicy": {
            "minNodes": min_nodes,
            "maxNodes": max_nodes,
            "globalBatchSize": 64,
            "microBatchSize": 4,
        },
    }
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    return {
        "apiVersion": "keepstep.dev/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": "ns", "uid": UID, "generation": 1},
        "spec": spec,
        "status": status or {},
    }


def job(**kwargs: Any) -> Job:
    return Job.from_object(job_object(**kwargs))


def pod(
    index: int, phase: PodPhase = PodPhase.PENDING, *, name: str = "demo", **kw: Any
) -> PodView:
    return PodView(f"{name}-node-{index}", index, phase, **kw)


def running(index: int, since: float = T0, **kw: Any) -> PodView:
    return pod(index, PodPhase.RUNNING, running_since=since, **kw)


def agents(
    nodes: Sequence[str] = (),
    *,
    epoch: int = 1,
    members: Sequence[str] | None = None,
    owner: str | None = UID,
    **kw: Any,
) -> AgentView:
    """Agents that agreed `epoch` with one worker per node in `nodes`."""
    members = [f"{n}/0" for n in nodes] if members is None else list(members)
    records = {n: NodeRecord(n, "127.0.0.1", 0, 1) for n in nodes}
    return AgentView(
        owner_uid=owner,
        nodes=records,
        epoch=EpochRecord(epoch, members) if members else None,
        records=len(records) + int(bool(members)),
        **kw,
    )


def done(members: Sequence[str], sha: str = SHA) -> dict[str, DoneRecord]:
    return {m.replace("/", "-"): DoneRecord(m, 100, sha) for m in members}


def progress(node: str, step: int, epoch: int = 1, world: int = 3, **kw: Any) -> ProgressRecord:
    return ProgressRecord(node, step, epoch, world, **kw)


class Cluster:
    """What the API server and etcd would hold after applying decisions: enough to check
    that a second reconcile over the result changes nothing."""

    def __init__(self, obj: dict[str, Any], agents: AgentView | None = None) -> None:
        self.obj = copy.deepcopy(obj)
        self.pods: dict[str, PodView] = {}
        self.service = False
        self.policy = False
        self.agents = agents if agents is not None else AgentView()

    @property
    def job(self) -> Job:
        return Job.from_object(self.obj)

    def apply(self, decision: Decision) -> None:
        for action in decision.actions:
            if isinstance(action, CreatePod):
                self.pods.setdefault(
                    action.name, PodView(action.name, action.index, PodPhase.PENDING)
                )
            elif isinstance(action, DeletePod):
                self.pods.pop(action.name, None)
            elif isinstance(action, EnsureService):
                self.service = True
            elif isinstance(action, EnsureNetworkPolicy):
                self.policy = True
            elif isinstance(action, ClaimPrefix):
                base = AgentView() if action.reset else self.agents
                self.agents = replace(base, owner_uid=action.uid)
            elif isinstance(action, PatchStatus):  # a JSON merge patch, as the API applies it
                merged = {**self.obj.get("status", {}), **action.patch}
                self.obj["status"] = {k: v for k, v in merged.items() if v is not None}

    def pod_list(self) -> list[PodView]:
        return sorted(self.pods.values(), key=lambda p: p.index)


def run(
    j: Job,
    pods: list[PodView],
    ag: AgentView | None,
    now: float = T0,
    service_exists: bool = True,
    policy_exists: bool = True,
) -> Decision:
    return decide(
        j,
        pods,
        ag,
        now,
        config=CONFIG,
        service_exists=service_exists,
        policy_exists=policy_exists,
    )


def settle(cluster: Cluster, now: float = T0, rounds: int = 3) -> Decision:
    """Reconcile until nothing changes; returns the last (empty) decision."""
    for _ in range(rounds):
        d = run(
            cluster.job,
            cluster.pod_list(),
            cluster.agents,
            now,
            service_exists=cluster.service,
            policy_exists=cluster.policy,
        )
        if not d.actions:
            return d
        cluster.apply(d)
    raise AssertionError(f"still acting after {rounds} rounds: {d.reason}")


def names(actions: list[Any]) -> list[str]:
    return [a.name for a in actions]
