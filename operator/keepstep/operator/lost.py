"""Which of a job's pods are lost, and which of those losses count as failures.

Where it sits: `decide` calls `find_losses` with the job's present pods before it decides
the pod actions; the lost ones are deleted and replaced, and their failures go into the
job's `failures.Ledger`. Pure.

A pod is lost when it Failed, when its agent exited before the job finished, when it
runs while the job runs but its agent's record has been missing from etcd for longer than
the grace (a killed node leaves its pod "Running"), or when it stayed Pending past the
failure policy's grace (`failures.classify`). Only the first is counted as a failure when
its agent failed (CrashLoop), the second always, the third never (a node's loss is what
keepstep is for), the last as PodsUnschedulable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from keepstep.operator.failures import Failure, Ledger, classify, crashed
from keepstep.operator.model import AgentView, Job, Phase, PodPhase, PodView
from keepstep.operator.settings import DecideConfig


@dataclass(frozen=True)
class Losses:
    """The pods this decision takes as lost (name -> why, and the failure it counts as)
    and the pods left to wait for a node."""

    lost: dict[str, tuple[str, Failure | None]] = field(default_factory=dict)
    waiting: tuple[PodView, ...] = ()


def lost_reason(
    pod: PodView, agents: AgentView | None, now: float, config: DecideConfig, phase: Phase
) -> str | None:
    """Why `pod` is lost, or None if it is not."""
    if pod.phase is PodPhase.FAILED:
        return "pod Failed"
    if agents is None:
        return None
    if pod.phase is PodPhase.SUCCEEDED:
        names = {d.node.rpartition("/")[0] or d.node for d in agents.done.values()}
        return None if pod.name in names else "agent exited before the job finished"
    if phase is not Phase.RUNNING or pod.phase not in (PodPhase.RUNNING, PodPhase.UNKNOWN):
        return None
    if pod.name in agents.nodes:
        return None
    # A killed node leaves its pod "Running" on a NotReady node; only the agent's leased
    # record in etcd tells. Missing since it was last seen, or since the pod started; an
    # agent never seen yet is still starting (importing torch, building its model).
    seen = agents.last_seen.get(pod.name)
    missing_since = max(pod.running_since or now, seen or 0.0)
    grace = config.lost_pod_s if seen is not None else config.agent_start_s
    if now - missing_since > grace:
        return f"agent record missing from etcd for {now - missing_since:.0f} s"
    return None


def find_losses(
    job: Job,
    present: Sequence[PodView],
    agents: AgentView | None,
    now: float,
    config: DecideConfig,
    phase: Phase,
    ledger: Ledger,
) -> Losses:
    """Which pods are lost and why; the failures among them go into `ledger`."""
    min_nodes = min(job.spec.min_nodes, job.spec.desired_nodes)
    # The job trains without a pod that only waits for a node: leave it waiting.
    trains = phase is Phase.RUNNING and agents is not None and len(agents.nodes) >= min_nodes
    out = Losses()
    waiting: list[PodView] = []
    for pod in present:
        why = lost_reason(pod, agents, now, config, phase)
        failure = None
        judged = classify(pod, now, ledger.policy, waits_for_capacity_ok=trains)
        if judged is not None:
            why, failure = judged
        elif why is not None and pod.phase is PodPhase.SUCCEEDED:
            failure = crashed(pod, now, why)
        elif why is None and trains and pod.waiting == "Unschedulable":
            if pod.created_at is not None and now - pod.created_at > ledger.policy.pending_s:
                waiting.append(pod)
        if why is not None:
            out.lost[pod.name] = (why, failure)
        if failure is not None:
            ledger.add(failure, replace_at_once=True)
    return Losses(out.lost, tuple(waiting))
