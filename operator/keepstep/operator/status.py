"""TrainJob status: figures from the agents' records, conditions, and the patch to write.

Where it sits: `decide` builds the new status on a copy with these pure functions and asks
for a `PatchStatus` only when `status_patch` finds a difference, so a reconcile that
changes nothing writes nothing. Figures come from keepstep.agent.protocol records:
ProgressRecord (step, epoch, samples/s, last MTTR), the recoveries/ entries (count and
MTTR per epoch), EpochRecord (worldSize) and DoneRecord (paramsSha256).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keepstep.operator.model import AgentView, Job, Phase, format_time
from keepstep.operator.podspec import selector

# The status fields this operator owns; anything else under status (a framework's own
# bookkeeping) is left alone.
OWNED = (
    "phase",
    "nodes",
    "worldSize",
    "step",
    "lastSnapshotStep",
    "snapshotBytes",
    "epoch",
    "recoveries",
    "mttrP50Seconds",
    "lastMttrSeconds",
    "samplesPerSecond",
    "paramsSha256",
    "selector",
    "nextPodIndex",
    "observedGeneration",
    "belowMinNodesSince",
    "podFailures",
    "createBackoffUntil",
    "conditions",
)
# Kept from the last status while the agents have no newer record of them (after a
# suspension the prefix is reset; the figures stay until the resumed run reports).
_STICKY = (
    "step",
    "lastSnapshotStep",
    "snapshotBytes",
    "epoch",
    "samplesPerSecond",
    "recoveries",
    "mttrP50Seconds",
    "lastMttrSeconds",
)


def agent_figures(agents: AgentView | None, old: Mapping[str, Any]) -> dict[str, Any]:
    """The status figures the agents report; the old ones where etcd was unreachable."""
    if agents is None:
        return {k: old[k] for k in ("nodes", "worldSize", *_STICKY, "paramsSha256") if k in old}
    out: dict[str, Any] = {k: old[k] for k in _STICKY if k in old}
    out["nodes"] = len(agents.nodes)
    out["worldSize"] = len(agents.epoch.members) if agents.epoch is not None else 0
    progress = list(agents.progress.values())
    if progress:
        newest = max(progress, key=lambda p: (p.epoch, p.step))
        out["step"] = max(p.step for p in progress)
        out["epoch"] = newest.epoch
        out["samplesPerSecond"] = round(float(newest.samples_per_s), 1)
        # Every member holds a snapshot of at least this step: what a recovery rolls back to.
        current = [p for p in progress if p.epoch == newest.epoch]
        out["lastSnapshotStep"] = min(p.step for p in current)
        largest = max(p.snapshot_bytes for p in progress)
        if largest > 0:  # the largest node's snapshot files: what /dev/shm must hold
            out["snapshotBytes"] = max(largest, int(out.get("snapshotBytes", 0)))
    if agents.epoch is not None:
        out["epoch"] = max(int(out.get("epoch", 0)), agents.epoch.epoch)
    out.setdefault("step", 0)
    out.setdefault("epoch", 0)
    out.update(_mttr(agents, out))
    hashes = {d.params_sha256 for d in agents.done.values()}
    if agents.complete() and len(hashes) == 1:
        out["paramsSha256"] = hashes.pop()
    return out


def _mttr(agents: AgentView, old: Mapping[str, Any]) -> dict[str, Any]:
    """recoveries (epochs entered after the first), MTTR p50 and last."""
    out: dict[str, Any] = {k: old[k] for k in ("mttrP50Seconds", "lastMttrSeconds") if k in old}
    epochs = {r.epoch for r in agents.recoveries if r.epoch > 0}
    out["recoveries"] = len(epochs) if epochs else int(old.get("recoveries", 0))
    # An epoch's MTTR is its slowest member's: the job resumes when all of them have.
    per_epoch: dict[int, float] = {}
    for r in agents.recoveries:
        if r.epoch > 0 and r.mttr_s is not None:
            per_epoch[r.epoch] = max(per_epoch.get(r.epoch, 0.0), r.mttr_s)
    if per_epoch:
        ordered = [per_epoch[e] for e in sorted(per_epoch)]
        out["mttrP50Seconds"] = round(statistics.median(ordered), 3)
        out["lastMttrSeconds"] = round(ordered[-1], 3)
        return out
    # Agents that measure MTTR themselves report the last one with their progress.
    reported = [p for p in agents.progress.values() if p.last_mttr_s is not None]
    if reported:
        newest = max(reported, key=lambda p: (p.epoch, p.step))
        out["lastMttrSeconds"] = round(float(newest.last_mttr_s or 0.0), 3)
    return out


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


def conditions(
    old: Sequence[Mapping[str, Any]], wanted: Sequence[Condition], now: float
) -> list[dict[str, Any]]:
    """The new conditions list: a condition appears once it is first True and then stays
    (True or False); lastTransitionTime moves only when its status flips."""
    by_type = {c.get("type"): c for c in old if isinstance(c, Mapping)}
    out: list[dict[str, Any]] = []
    for want in wanted:
        prev = by_type.get(want.type)
        if prev is None and not want.status:
            continue
        status = "True" if want.status else "False"
        since = format_time(now)
        if prev is not None and prev.get("status") == status and prev.get("lastTransitionTime"):
            since = str(prev["lastTransitionTime"])
        out.append(
            {
                "type": want.type,
                "status": status,
                "reason": want.reason,
                "message": want.message,
                "lastTransitionTime": since,
            }
        )
    return out


def with_condition(
    listed: Sequence[Mapping[str, Any]], want: Condition, now: float
) -> list[dict[str, Any]]:
    """`listed` with one condition set (replaced where it is, else added at the end)."""
    same = [c for c in listed if c.get("type") == want.type]
    updated = conditions(same, [want], now)
    if not updated:  # False and never listed: nothing to say
        return [dict(c) for c in listed]
    if not same:
        return [*(dict(c) for c in listed), updated[0]]
    return [updated[0] if c.get("type") == want.type else dict(c) for c in listed]


def build_status(
    job: Job,
    agents: AgentView | None,
    now: float,
    phase: Phase,
    why: str,
    below_min_since: float | None,
    next_index: int,
    *,
    extra: Sequence[Condition] = (),
    failed_reason: str = "",
) -> dict[str, Any]:
    """The status `decide` wants (computed on a copy: the observed one is not touched);
    `extra`: conditions decided elsewhere, listed after the phase's own; `failed_reason`:
    the Failed condition's reason when the phase is Failed (default: the phase)."""
    old = job.status
    new: dict[str, Any] = {
        "phase": str(phase),
        "selector": selector(job.name),
        "nextPodIndex": next_index,
        "observedGeneration": job.generation,
        **agent_figures(agents, old),
    }
    if below_min_since is not None:
        new["belowMinNodesSince"] = format_time(below_min_since)
    if job.phase is not None and job.phase.final:
        # The conditions say why the job ended; later reconciles must not reword them.
        if "conditions" in old:
            new["conditions"] = old["conditions"]
        return new
    below = below_min_since is not None
    wanted = [
        Condition("Running", phase is Phase.RUNNING, str(phase), why),
        Condition("Suspended", phase is Phase.SUSPENDED, str(phase), why),
        Condition(
            "BelowMinNodes",
            below,
            "TooFewAgents" if below else "EnoughAgents",
            why if below else "",
        ),
        Condition("Succeeded", phase is Phase.SUCCEEDED, str(phase), why),
        # Kubernetes Jobs and Kubeflow's TrainJob name success "Complete": tools that wait
        # for it (`kubectl wait --for=condition=Complete`) work on a TrainJob too.
        Condition("Complete", phase is Phase.SUCCEEDED, str(phase), why),
        Condition("Failed", phase is Phase.FAILED, failed_reason or str(phase), why),
        *extra,
    ]
    listed = conditions(old.get("conditions") or [], wanted, now)
    if listed:
        new["conditions"] = listed
    return new


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning `old` into `new` on the owned fields; {} if equal."""
    patch: dict[str, Any] = {}
    for name in OWNED:
        before, after = old.get(name), new.get(name)
        if before != after:
            patch[name] = after
    return patch


def phase_of(status: Mapping[str, Any]) -> Phase | None:
    return Phase.parse(status.get("phase"))
