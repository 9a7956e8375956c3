"""The reconcile decision: a pure function of one observed snapshot and `now`.

Where it sits: `reconcile` observes a TrainJob, its pods, its Service, its NetworkPolicy
and its agents' etcd records, calls `decide`, and applies the returned actions in order.
The same call runs on every event and on a timer (level-triggered), so every sub-decision
is idempotent and the status is computed on a copy and patched only when it differs: a
snapshot in which nothing changed yields no actions at all.

Sub-decisions, in order (each reads the snapshot and what the earlier ones chose):
  1. prefix   stamp the job's etcd prefix with its uid (reset it if it holds another job's
              records, or a suspended run's once its pods are gone: `suspension`)
  2. service  the NetworkPolicy (only the job's own pods reach its pods) exists, created
              before any pod, then the headless Service
  3. phase    Succeeded when every worker of the current epoch reported done; Suspended
              while spec.suspend; Pending after it until no pod and no agent record of the
              suspended run is left; Running once the agents agreed an epoch; Failed after
              more than the grace below minNodes live agents; Succeeded and Failed are final
  4. failures  lost pods that count against the job's failure budget (crashed agents,
              pods stuck Pending past the grace: `failures`); one more than the budget
              fails the job, with the cause as the Failed condition's reason
  5. pods     delete lost pods (Failed, exited unfinished, stuck Pending, or Running while
              their agent's record has been missing from etcd for longer than the grace)
              and replace them with new indices, not before status.createBackoffUntil;
              create or delete (highest index first) to follow numNodes, never above
              maxNodes; delete every pod of a suspended job (none created until its
              suspended run ended) and the unfinished pods of a failed one
  6. events   one per change
  7. status   figures from the agents, conditions; PatchStatus only on a difference, and
              as the last action

The decision assumes its pod creations succeed; where the API server refuses some,
`refusal.after_refusal` rewrites its events and status from the refusals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keepstep.operator.actions import (
    Action,
    CreatePod,
    Decision,
    DeleteCause,
    DeletePod,
    EnsureNetworkPolicy,
    EnsureService,
    Event,
    EventType,
    PatchStatus,
)
from keepstep.operator.failures import Ledger, Policy
from keepstep.operator.lost import Losses, find_losses
from keepstep.operator.model import (
    AgentView,
    Job,
    Phase,
    PodPhase,
    PodView,
    parse_time,
)
from keepstep.operator.podspec import (
    network_policy_manifest,
    pod_manifest,
    resumes_from_checkpoint,
    service_manifest,
)
from keepstep.operator.settings import DecideConfig
from keepstep.operator.status import (
    OWNED,
    Condition,
    build_status,
    conditions,
    phase_of,
    status_patch,
)
from keepstep.operator.suspension import (
    SuspendedRun,
    prefix_claim,
    resuming_condition,
    suspended_run,
    waiting,
)

_NAMES_IN_EVENT = 5
CREATED = "CreatedPods"  # the event of a decision's pod creations (`refusal` rewrites it)


@dataclass
class _Plan:
    """The decision under construction (local to one `decide` call)."""

    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Phase:
    phase: Phase
    why: str
    below_min_since: float | None = None
    reason: str = ""  # the Failed condition's reason (default: the phase)


def decide(
    job: Job,
    pods: Sequence[PodView],
    agents: AgentView | None,
    now: float,
    *,
    config: DecideConfig,
    service_exists: bool = True,
    policy_exists: bool = True,
) -> Decision:
    """What to do about `job`. `agents` is None when etcd could not be read: nothing that
    depends on the agents' records is decided then, and their figures are kept.
    `service_exists`, `policy_exists`: whether its Service and NetworkPolicy exist."""
    if job.deleting:
        return Decision(
            (), "being deleted: the finalizer cleans up, nothing to reconcile", job.status
        )
    plan = _Plan()
    left = suspended_run(job, pods, agents)
    claim = prefix_claim(job, agents, left)
    if claim is not None:
        plan.actions.append(claim[0])
        plan.reasons.append(claim[1])
    if not policy_exists and not (job.phase and job.phase.final):
        plan.actions.append(EnsureNetworkPolicy(network_policy_manifest(job)))
        plan.events.append(
            Event(EventType.NORMAL, "CreatedNetworkPolicy", f"only {job.name}'s pods reach them")
        )
        plan.reasons.append("network policy missing")
    if not service_exists and not (job.phase and job.phase.final):
        plan.actions.append(EnsureService(service_manifest(job)))
        plan.events.append(Event(EventType.NORMAL, "CreatedService", f"headless {job.name}"))
        plan.reasons.append("service missing")
    hold = waiting(job, left)
    phase = _phase(job, agents, now, config, left if hold else None)
    ledger = Ledger.of(job.status, now, Policy.of(job.spec.failure, config))
    present = sorted((p for p in pods if p.owned and not p.terminating), key=lambda p: p.index)
    losses = Losses()
    if phase.phase in (Phase.PENDING, Phase.RUNNING) and not hold:
        losses = find_losses(job, present, agents, now, config, phase.phase, ledger)
        spent = ledger.spent()
        if spent is not None:
            phase = _Phase(Phase.FAILED, ledger.verdict(spent), phase.below_min_since, str(spent))
    next_index, creating = _pods(
        job, pods, present, losses, phase.phase, plan, hold, ledger, config
    )
    refused = _true(job.status, "PodCreateRefused") and not creating
    new_status = build_status(
        job,
        agents,
        now,
        phase.phase,
        phase.why,
        phase.below_min_since,
        next_index,
        extra=[resuming_condition(job, left), *ledger.conditions(refused, losses.waiting)],
        failed_reason=phase.reason,
    )
    if job.phase is not None and job.phase.final:  # the record of a finished job stays
        kept = {k: job.status.get(k) for k in ("podFailures", "createBackoffUntil")}
    else:
        kept = ledger.status_fields()
    new_status.update({k: v for k, v in kept.items() if v is not None})
    patch = status_patch(job.status, new_status)
    old_phase = job.phase
    if phase.phase != old_phase:
        kind = EventType.WARNING if phase.phase is Phase.FAILED else EventType.NORMAL
        what = f"{old_phase or 'new'} -> {phase.phase}: {phase.why}"
        plan.events.append(Event(kind, str(phase.phase), what))
        plan.reasons.append(f"phase {what}")
    if "belowMinNodesSince" in patch and patch["belowMinNodesSince"] is not None:
        live = len(agents.nodes) if agents is not None else 0
        plan.events.append(
            Event(
                EventType.WARNING,
                "BelowMinNodes",
                f"{live} live agents, minNodes {job.spec.min_nodes}: the job fails after "
                f"{config.below_min_s:g} s",
            )
        )
    # The status patch goes last: whoever sees the new status sees all the reconcile did.
    status_write = [PatchStatus(patch)] if patch else []
    if patch:
        plan.reasons.append("status: " + ", ".join(sorted(patch)))
    actions = (*plan.actions, *plan.events, *status_write)
    if not actions:
        live = sum(1 for p in pods if p.owned and not p.terminating)
        reason = f"nothing to do: {phase.phase}, {live} pods, status unchanged"
        if plan.reasons:  # a wait that writes nothing (a backoff) is still said
            reason += f" ({'; '.join(plan.reasons)})"
        return Decision((), reason, new_status)
    return Decision(actions, "; ".join(plan.reasons), new_status)


def decide_invalid(job_obj: dict[str, Any], error: str, now: float) -> Decision:
    """A TrainJob whose spec can never work: mark it Failed (once) and say why."""
    old = job_obj.get("status") or {}
    if (phase_of(old) or Phase.PENDING).final:
        return Decision((), f"invalid spec, already {old.get('phase')}: {error}", old)
    failed = Condition("Failed", True, "InvalidSpec", error)
    new = {
        **{k: old[k] for k in OWNED if k in old},
        "phase": str(Phase.FAILED),
        "observedGeneration": int((job_obj.get("metadata") or {}).get("generation") or 0),
        "conditions": conditions(old.get("conditions") or [], [failed], now),
    }
    actions = (
        PatchStatus(status_patch(old, new)),
        Event(EventType.WARNING, "InvalidSpec", error),
    )
    return Decision(actions, f"invalid spec: {error}", new)


def _phase(
    job: Job,
    agents: AgentView | None,
    now: float,
    config: DecideConfig,
    left: SuspendedRun | None,
) -> _Phase:
    old = job.phase or Phase.PENDING
    since = parse_time(job.status.get("belowMinNodesSince"))
    if old.final:
        return _Phase(old, "final", since)  # kept as it was when the job ended
    if agents is not None and agents.complete():
        hashes = {d.params_sha256 for d in agents.done.values()}
        if len(hashes) == 1:
            return _Phase(Phase.SUCCEEDED, "every worker of the epoch reported done")
        return _Phase(Phase.FAILED, f"workers finished with {len(hashes)} different parameters")
    if job.spec.suspend:
        return _Phase(Phase.SUSPENDED, "spec.suspend is true")
    if left is not None:  # its records would make the job look Running already
        return _Phase(Phase.PENDING, left.why)
    if agents is None:
        running = old is Phase.RUNNING
    else:
        running = old is Phase.RUNNING or (agents.epoch is not None and bool(agents.nodes))
    if not running:
        return _Phase(Phase.PENDING, "waiting for the agents to agree an epoch")
    min_nodes = min(job.spec.min_nodes, job.spec.desired_nodes)
    if agents is None:
        return _Phase(Phase.RUNNING, "etcd unreachable", since)
    live = len(agents.nodes)
    if live >= min_nodes:
        return _Phase(Phase.RUNNING, f"{live} agents in epoch {_epoch(agents)}")
    since = now if since is None else since
    if now - since >= config.below_min_s:
        why = f"{live} live agents < minNodes {min_nodes} for {now - since:.0f} s"
        return _Phase(Phase.FAILED, why, since)
    return _Phase(Phase.RUNNING, f"{live} live agents < minNodes {min_nodes}", since)


def _epoch(agents: AgentView) -> int:
    return agents.epoch.epoch if agents.epoch is not None else 0


def _true(status: Mapping[str, Any], kind: str) -> bool:
    listed = status.get("conditions")
    return isinstance(listed, list) and any(
        isinstance(c, Mapping) and c.get("type") == kind and c.get("status") == "True"
        for c in listed
    )


def _pods(
    job: Job,
    pods: Sequence[PodView],
    present: Sequence[PodView],
    losses: Losses,
    phase: Phase,
    plan: _Plan,
    hold: bool,
    ledger: Ledger,
    config: DecideConfig,
) -> tuple[int, bool]:
    """Add the pod actions; returns the next unused pod index and whether pods are created.
    `hold`: the resumed run waits for the suspended one to end (its pods are deleted, none
    is created)."""
    next_index = max([int(job.status.get("nextPodIndex") or 0), *(p.index + 1 for p in pods)])
    if phase is Phase.SUCCEEDED:
        return next_index, False
    if phase in (Phase.SUSPENDED, Phase.FAILED) or hold:
        every = phase is Phase.SUSPENDED or hold
        doomed = [
            p for p in present if every or p.phase not in (PodPhase.SUCCEEDED, PodPhase.FAILED)
        ]
        what = "the suspended run ends" if hold else f"job {phase}"
        cause = DeleteCause.JOB_FAILED if phase is Phase.FAILED else DeleteCause.SUSPENDED
        for pod in doomed:
            plan.actions.append(DeletePod(pod.name, what, cause))
        if doomed:
            plan.reasons.append(f"deleted {len(doomed)} pods: {what}")
            plan.events.append(Event(EventType.NORMAL, "DeletedPods", f"{what}: {_names(doomed)}"))
        elif hold and pods:
            plan.reasons.append(f"{len(pods)} pods of the suspended run still terminating")
        return next_index, False
    live: list[PodView] = []
    lost_nodes: list[str] = []
    for pod in present:
        if pod.name not in losses.lost:
            live.append(pod)
            continue
        why, failure = losses.lost[pod.name]
        if pod.node:
            lost_nodes.append(pod.node)
        plan.actions.append(DeletePod(pod.name, why, DeleteCause.LOST, grace_seconds=0))
        counted = f" [{failure.cause}: {failure.reason}]" if failure is not None else ""
        plan.events.append(Event(EventType.WARNING, "PodLost", f"{pod.name}: {why}{counted}"))
        plan.reasons.append(f"lost {pod.name} ({why})")
    desired = job.spec.desired_nodes
    wait = ledger.backing_off()
    if len(live) < desired and wait is not None:
        plan.reasons.append(f"{desired - len(live)} pods to create: backing off for {wait:.0f} s")
        return next_index, False
    if len(live) < desired:
        resume = resumes_from_checkpoint(job, phase)
        created = [
            # The node-lifecycle controller marks a dead node NotReady only after its
            # grace; until then the scheduler would happily bind the replacement there.
            CreatePod(
                i,
                pod_manifest(
                    job,
                    i,
                    config.etcd,
                    lost_nodes,
                    resume=resume,
                    etcd_tls=config.etcd_tls,
                    env_defaults=config.agent_env,
                ),
            )
            for i in range(next_index, next_index + desired - len(live))
        ]
        plan.actions.extend(created)
        next_index += len(created)
        what = f"{len(created)}: {_names(created)}"
        if resume and job.spec.checkpoint is not None:
            what += f", resuming from the newest checkpoint at {job.spec.checkpoint.uri}"
        plan.reasons.append(f"created {len(created)} pods ({len(live)} live, {desired} desired)")
        plan.events.append(Event(EventType.NORMAL, CREATED, what))
        return next_index, True
    if len(live) > desired:
        # The newest pods go first; each agent drains on SIGTERM at a step boundary.
        extra = sorted(live, key=lambda p: p.index)[desired:]
        for pod in reversed(extra):
            plan.actions.append(
                DeletePod(pod.name, f"scale down to {desired}", DeleteCause.SCALE_DOWN)
            )
        plan.reasons.append(f"scaled down {len(live)} -> {desired}")
        plan.events.append(Event(EventType.NORMAL, "ScaledDown", _names(extra)))
    return next_index, False


def _names(items: Sequence[PodView | CreatePod]) -> str:
    names = [i.name for i in items]
    more = len(names) - _NAMES_IN_EVENT
    return ", ".join(names[:_NAMES_IN_EVENT]) + (f" and {more} more" if more > 0 else "")
