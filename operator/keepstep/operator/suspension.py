"""From a suspended run to its resumed run: what is left of the old run, and the gate.

Where it sits: `decide` calls `suspended_run` before its other sub-decisions. A suspension
deletes every pod of the job; once they are gone the operator clears the agents' etcd
records (a `ClaimPrefix` reset). The resumed run may start only after both: a new agent
that met the old run's epoch record would join that dead epoch, and the stale record would
make the job look Running at once, so its pods would lose `--resume` and start from step 0.

The hand-over is level-triggered and survives across reconciles in the status: it begins
with phase Suspended, and after un-suspending the `Resuming` condition (True) says the
resumed run waits for the suspended one to end. The condition turns False in the reconcile
that creates the resumed run's pods, in the same status patch that advances nextPodIndex;
a pod of the job at or above the nextPodIndex the status holds was created after that
point (a lost status patch), so its run already started and nothing is waited for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from keepstep.operator.actions import ClaimPrefix
from keepstep.operator.model import AgentView, Job, Phase, PodView
from keepstep.operator.status import Condition

RESUMING = "Resuming"
WAITING = "waiting for the suspended run to end"


@dataclass(frozen=True)
class SuspendedRun:
    """What is left of a job's suspended run: `pods` still listed (terminating included)
    and `records` of its agents in etcd (None: etcd could not be read)."""

    pods: int
    records: int | None

    def __post_init__(self) -> None:
        if self.pods < 0 or (self.records is not None and self.records < 0):
            raise ValueError(f"pods={self.pods!r}, records={self.records!r}: counts must be >= 0")

    @property
    def ended(self) -> bool:
        """No pod and no agent record of the run is left: the resumed run may start."""
        return self.pods == 0 and self.records == 0

    @property
    def clear_records(self) -> bool:
        """Its pods are gone but their agents' records are not: reset the prefix now."""
        return self.pods == 0 and bool(self.records)

    @property
    def why(self) -> str:
        """What the resumed run waits for (constant per stage: a 1000-pod run that
        drains writes the status once, not once per pod)."""
        if self.pods:
            return f"{WAITING}: its pods are terminating"
        if self.records is None:
            return f"{WAITING}: etcd unreachable, its agent records unknown"
        if self.records:
            return f"{WAITING}: its agent records are being cleared"
        return "the suspended run ended: its pods and agent records are gone"


def resuming(status: Mapping[str, object]) -> bool:
    """The status says the job waits for its suspended run to end."""
    listed = status.get("conditions")
    if not isinstance(listed, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == RESUMING and c.get("status") == "True"
        for c in listed
    )


def suspended_run(
    job: Job, pods: Sequence[PodView], agents: AgentView | None
) -> SuspendedRun | None:
    """What is left of the job's suspended run, or None when there is none to wait for
    or clean up (never suspended, a final phase, or the resumed run started)."""
    if job.phase is None or job.phase.final:
        return None
    if job.phase is not Phase.SUSPENDED and not resuming(job.status):
        return None
    boundary = int(job.status.get("nextPodIndex") or 0)
    if not job.spec.suspend and any(p.owned and p.index >= boundary for p in pods):
        return None
    # A pod of an earlier job with this name counts too: its agent writes the same prefix.
    return SuspendedRun(len(pods), agents.records if agents is not None else None)


def waiting(job: Job, left: SuspendedRun | None) -> bool:
    """The resumed run must not start yet (nor look Running from the old records)."""
    return left is not None and not job.spec.suspend and not left.ended


def resuming_condition(job: Job, left: SuspendedRun | None) -> Condition:
    """The `Resuming` condition `build_status` lists (it appears once first True)."""
    if left is not None and waiting(job, left):
        return Condition(RESUMING, True, "SuspendedRunEnding", left.why)
    if job.spec.suspend:
        return Condition(RESUMING, False, "Suspended", "spec.suspend is true")
    why = "the suspended run's pods and agent records are gone"
    return Condition(RESUMING, False, "SuspendedRunEnded", why)


def prefix_claim(
    job: Job, agents: AgentView | None, left: SuspendedRun | None
) -> tuple[ClaimPrefix, str] | None:
    """The etcd prefix claim this reconcile needs, with its reason, or None."""
    if agents is None:
        return None
    if agents.owner_uid is not None and agents.owner_uid != job.uid:
        reason = f"etcd prefix held records of job uid {agents.owner_uid}: reset"
        return ClaimPrefix(job.key, job.uid, reset=True), reason
    if left is not None and left.clear_records:
        reason = f"suspended run: {agents.records} agent records cleared"
        return ClaimPrefix(job.key, job.uid, reset=True), reason
    if agents.owner_uid is None:
        return ClaimPrefix(job.key, job.uid), "etcd prefix claimed"
    return None
