"""When the API server refuses pod creations: the decision's events and status, rewritten.

Where it sits: `reconcile` applies a decision's writes first (Service, deletions, creations)
and, when `kube.Kube.apply` reports `Refusal`s, calls `after_refusal` for the events and the
status patch it then applies instead of the decision's own, in the same reconcile. Pure, like
`decide`: a refusal is one more observation.

What changes: the CreatedPods event names only the pods that were created; a Warning event
`PodCreateRefused` gives the API server's reason and message; the status records the refused
attempt in status.podFailures, sets status.createBackoffUntil (exponential, see `failures`),
sets the `PodCreateRefused` condition to the API server's reason and message, and keeps
nextPodIndex below the names that were never created. An attempt more than the job's
failurePolicy.backoffLimit within the window fails the job with reason PodCreateRefused.
"""

from __future__ import annotations

from collections.abc import Sequence

from keepstep.operator.actions import (
    Action,
    CreatePod,
    Decision,
    Event,
    EventType,
    PatchStatus,
    Refusal,
)
from keepstep.operator.decide import CREATED
from keepstep.operator.failures import Cause, Failure, Ledger, Policy
from keepstep.operator.model import Job, Phase
from keepstep.operator.settings import DecideConfig
from keepstep.operator.status import Condition, status_patch, with_condition


def after_refusal(
    job: Job, decision: Decision, refused: Sequence[Refusal], now: float, config: DecideConfig
) -> Decision:
    """The events and status patch of `decision` once the API server refused `refused`
    of its pod creations (the other actions were applied already and are not repeated)."""
    creates: list[CreatePod] = decision.of(CreatePod)
    names = {r.pod for r in refused}
    made = [c for c in creates if c.name not in names]
    first = refused[0]  # in the order of the creations
    new = dict(decision.status)
    ledger = Ledger.of(new, now, Policy.of(job.spec.failure, config))
    cause = Cause.POD_CREATE_REFUSED
    ledger.add(Failure(cause, now, first.reason, first.message, first.pod), replace_at_once=False)
    wait = ledger.backing_off() or 0.0
    if creates:  # a name never created may be used again
        new["nextPodIndex"] = max([creates[0].index, *(c.index + 1 for c in made)])
    for key, value in ledger.status_fields().items():
        if value is None:
            new.pop(key, None)
        else:
            new[key] = value
    (condition,) = [c for c in ledger.conditions(refused=True) if c.type == str(cause)]
    listed = with_condition(new.get("conditions") or [], condition, now)
    events: list[Action] = [e for e in decision.of(Event) if e.reason != CREATED]
    if made:
        events.append(Event(EventType.NORMAL, CREATED, f"{len(made)}: {_names(made)}"))
    what = f"{len(refused)} of {len(creates)} pods refused: {first.reason}: {first.message}"
    events.append(Event(EventType.WARNING, str(cause), f"{what}; next attempt in {wait:.0f} s"))
    reason = f"{decision.reason}; {len(refused)} pod creations refused ({first.reason})"
    spent = ledger.spent()
    old = Phase.parse(new.get("phase")) or Phase.PENDING
    if spent is not None and not old.final:
        why = ledger.verdict(spent)
        new["phase"] = str(Phase.FAILED)
        listed = with_condition(listed, Condition("Running", False, str(Phase.FAILED), why), now)
        listed = with_condition(listed, Condition("Failed", True, str(spent), why), now)
        events.append(Event(EventType.WARNING, str(Phase.FAILED), f"{old} -> Failed: {why}"))
        reason += f"; phase {old} -> Failed: {why}"
    else:
        reason += f": backing off for {wait:.0f} s"
    new["conditions"] = listed
    patch = status_patch(job.status, new)
    actions = (*events, PatchStatus(patch)) if patch else tuple(events)
    return Decision(actions, reason, new)


def _names(creates: Sequence[CreatePod], shown: int = 5) -> str:
    more = len(creates) - shown
    listed = ", ".join(c.name for c in creates[:shown])
    return listed + (f" and {more} more" if more > 0 else "")
