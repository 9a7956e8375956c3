"""One record per recovery, folded from event logs: the only derivation of MTTR and phases.

Where it sits: agents write events (`protocol.events`); `recoveries(events, faults)` turns
them into `RecoveryRecord`s. The run summary (`keepstep.launch.summary`) folds every
node's events with the launcher's fault log, the dashboard a live run's events so far,
the chaos runner the events with the faults its injector applied, and telemetry one
node's own events as they arrive (`telemetry.recovery.RecoveryTracker`, which folds
again when a commit may end a recovery). Pure: no I/O, no clock.

No single event is a recovery; one is spread over:

    fault-detected   who noticed a failure, when, and of which epoch
    epoch-agreed     the new membership; `planned` for a step-boundary change
    reconfigured     per worker: communicator_s, restore_s (reshard_s of it, when the
                     optimizer state is sharded, and reshard_bytes received), replan_s,
                     resume_step, rolled_back_steps
    commit           the first commit in the new epoch (or a later one) ends it

Each epoch after the first is one recovery. Its times:

    start    the injected fault that explains it (when `faults` are given and one does),
             else its first detection (or the `fault_t` that detection carries), else
             when agreement began (agreed - agree_s)
    detect   start -> the first detection (a planned change, announced rather than
             detected: -> when agreement began)
    agree    -> the epoch agreed
    communicator, restore, replan   the slowest member's figures
    mttr     start -> the first commit of this epoch or a later one (None before it):
             an epoch superseded by a fault during its recovery ends with the next

The view is what the events show: all nodes' logs give the job's recoveries; one node's
log gives those it agreed, timed from its own detection. That difference is in the
input, not in the fold.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from keepstep.agent.protocol import node_of
from keepstep.agent.protocol.events import Event, EventKind

PHASES = ("detect", "agree", "communicator", "restore", "replan", "first-step")


class Cause(enum.StrEnum):
    """The cause of a recovery that no injected fault and no detection explains."""

    JOIN = "join"  # members admitted that no earlier epoch had
    REJOIN = "rejoin"  # a member back (a restarted worker), with no fault of its own
    DRAIN = "drain"  # nodes let go at a step boundary
    PLANNED = "planned"  # another planned change
    # Members lacked sharded state an earlier fault took (its holder was restarting): the
    # epoch that admits a worker for it goes on with that fault's recovery.
    MISSING_STATE = "missing-state"
    UNKNOWN = "unknown"  # a failure whose detection is not in the events


class Effect(enum.Enum):
    """What an injected fault does to the membership: which epochs it can explain."""

    FAILURE = "failure"  # a member lost: an epoch agreed after a failure
    JOIN = "join"  # a node started: the planned epoch that admits it
    DRAIN = "drain"  # a node told to leave: a planned epoch that lets nodes go


@dataclass(frozen=True)
class InjectedFault:
    """A fault someone injected (the launcher's fault log, the chaos injector)."""

    kind: str  # as the injector names it: "kill-node", "join-node", ...
    t: float
    effect: Effect
    node: str | None = None


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery: the new epoch, what caused it, and how long each phase took (s).

    `cause` is the injected fault's kind, else the detection's cause, else a `Cause`;
    `node` the node it hit (the admitted or drained nodes of a planned change). `step` is
    the step training resumed from (the lowest resume step a member reported, else the
    epoch's start step). `fault` indexes the `faults` given, `absorbed` the others whose
    effect came inside this recovery (two nodes lost in one epoch, a join admitted with a
    failure); `start_t` and `end_t` are wall-clock seconds (`end_t` None while no commit
    ended the recovery).
    """

    cause: str
    node: str | None
    epoch: int
    step: int | None
    detect_s: float
    agree_s: float
    communicator_s: float
    restore_s: float
    replan_s: float
    mttr_s: float | None
    rolled_back_steps: int
    reason: str
    planned: bool = False
    members: tuple[str, ...] = ()
    start_t: float = 0.0
    end_t: float | None = None
    fault: int | None = None
    absorbed: tuple[int, ...] = ()  # other faults it recovered from too (into `faults`)
    timeout_scale: float = 1.0  # the new epoch's timeouts x their defaults (> 1: raised)
    reshard_s: float = 0.0  # of restore_s: the sharded optimizer state moved into shards
    reshard_bytes: int = 0  # that state's bytes the members received from peers, summed


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def recoveries(
    events: Iterable[Event], faults: Sequence[InjectedFault] = ()
) -> list[RecoveryRecord]:
    """One record per agreed epoch after the first, in epoch order. Events of kinds this
    fold does not use, or does not know, are ignored; so are fields it does not use."""
    ordered = sorted(events, key=lambda e: float(e["t"]))
    agreed: dict[int, Event] = {}
    for e in ordered:
        if e.get("kind") == EventKind.EPOCH_AGREED:
            agreed.setdefault(int(e["epoch"]), e)
    detected = _detections(ordered, agreed)
    reconfigured: dict[int, list[Event]] = {}
    first_commit: dict[int, float] = {}
    for e in ordered:
        if e.get("kind") == EventKind.RECONFIGURED:
            reconfigured.setdefault(int(e["epoch"]), []).append(e)
        elif e.get("kind") == EventKind.COMMIT:
            first_commit.setdefault(int(e["epoch"]), float(e["t"]))
    order = sorted(range(len(faults)), key=lambda i: faults[i].t)
    used: set[int] = set()
    known: set[str] = set()  # members of the epochs agreed so far
    in_job = {
        float(e["t"]): frozenset(node_of(str(m)) for m in e.get("members", ()))
        for e in agreed.values()
    }
    out = []
    for epoch in sorted(agreed):
        a = agreed[epoch]
        if epoch > 0:
            fault, absorbed = _matching_fault(a, faults, order, used, in_job)
            ends = [t for e, t in first_commit.items() if e >= epoch]
            record = _record(
                a,
                fault,
                faults[fault] if fault is not None else None,
                detected.get(epoch, []),
                reconfigured.get(epoch, []),
                min(ends, default=None),
                known,
            )
            out.append(replace(record, absorbed=absorbed))
        known |= {str(m) for m in (*a.get("members", ()), *a.get("removed", ()))}
    return out


def _detections(ordered: Sequence[Event], agreed: Mapping[int, Event]) -> dict[int, list[Event]]:
    """Each detection, under the epoch whose recovery it starts: the one after the epoch it
    names as failed, or (a log without the field) the first agreed at or after it. One
    node's log lacks the epochs other nodes agreed: its detection of such an epoch's
    failure starts no recovery there. A report that came after its epoch was agreed is
    late news, not the start."""
    out: dict[int, list[Event]] = {}
    for d in ordered:
        if d.get("kind") != EventKind.FAULT_DETECTED:
            continue
        t = float(d["t"])
        if "epoch" in d:
            target: int | None = int(d["epoch"]) + 1
        else:
            target = min((e for e, a in agreed.items() if float(a["t"]) >= t), default=None)
        if target is not None and target in agreed and t <= float(agreed[target]["t"]):
            out.setdefault(target, []).append(d)
    return out


def _record(
    a: Event,
    index: int | None,
    fault: InjectedFault | None,
    detections: Sequence[Event],
    recon: Sequence[Event],
    end: float | None,
    known: set[str],
) -> RecoveryRecord:
    agreed_t = float(a["t"])
    planned = bool(a.get("planned", False))
    # A planned change is announced, not detected: a detection before it is of another epoch.
    first = None if planned or not detections else detections[0]
    agree_began = agreed_t - float(a.get("agree_s", 0.0))
    detect_t = float(first["t"]) if first is not None else agree_began
    if fault is not None:
        start = fault.t
    elif first is not None:
        start = min(float(first.get("fault_t", detect_t)), detect_t)
    else:
        start = agree_began
    if fault is not None:
        cause, node = fault.kind, fault.node
    elif first is not None:
        cause, node = str(first.get("cause", Cause.UNKNOWN.value)), first.get("node")
    else:
        cause, node = _unexplained(a, planned, known)
    return RecoveryRecord(
        cause=cause,
        node=None if node is None else str(node),
        epoch=int(a["epoch"]),
        step=min((int(r["resume_step"]) for r in recon), default=_int(a.get("step"))),
        detect_s=max(detect_t - start, 0.0),
        agree_s=max(agreed_t - detect_t, 0.0),
        communicator_s=max((float(r["communicator_s"]) for r in recon), default=0.0),
        restore_s=max((float(r["restore_s"]) for r in recon), default=0.0),
        replan_s=max((float(r["replan_s"]) for r in recon), default=0.0),
        mttr_s=None if end is None else end - start,
        rolled_back_steps=max((int(r["rolled_back_steps"]) for r in recon), default=0),
        reason=str(a.get("reason", "")),
        planned=planned,
        members=tuple(str(m) for m in a.get("members", ())),
        start_t=start,
        end_t=end,
        fault=index,
        timeout_scale=float(a.get("timeout_scale", 1.0)),
        reshard_s=max((float(r.get("reshard_s", 0.0)) for r in recon), default=0.0),
        reshard_bytes=sum(int(r.get("reshard_bytes", 0)) for r in recon),
    )


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _unexplained(a: Event, planned: bool, known: set[str]) -> tuple[str, str | None]:
    """Cause and node of an epoch no fault or detection explains: a worker back after a
    restart, a join or a drain nobody injected, a failure whose detection is missing."""
    admitted = _changed(a, "admitted", "admit")
    drained = _changed(a, "removed", "drain")
    nodes = ",".join(sorted({node_of(m) for m in admitted or drained})) or None
    if not planned:
        return Cause.UNKNOWN.value, nodes
    if admitted:
        back = any(m in known for m in admitted)
        return (Cause.REJOIN if back else Cause.JOIN).value, nodes
    return (Cause.DRAIN if drained else Cause.PLANNED).value, nodes


def _changed(a: Event, field: str, word: str) -> list[str]:
    """The members an epoch admitted (`field` "admitted", `word` "admit") or let go
    ("removed", "drain"): from the event's field, or from its reason ("admit n1/0,n4/0;
    drain n2/0") in event logs written before the field existed."""
    members = a.get(field)
    if members is None:
        found = re.search(rf"\b{word} ([^;]+)", str(a.get("reason", "")))
        members = found.group(1).split(",") if found else []
    return sorted({str(m).strip() for m in members})


def _matching_fault(
    a: Event,
    faults: Sequence[InjectedFault],
    order: Sequence[int],
    used: set[int],
    in_job: Mapping[float, frozenset[str]],
) -> tuple[int | None, tuple[int, ...]]:
    """The unused fault, injected before this epoch was agreed, of an effect that explains
    it, and the other unused faults whose effect the epoch shows too (`absorbed`: it
    recovered from them as well, so no later epoch may take them).

    An epoch shows a join whose node it admits, a drain whose node it lets go, and a
    failure on a node it removed that was in the job when hit. A planned epoch is
    explained by the earliest join or drain it shows. An epoch agreed after a failure is
    explained by a failure it shows: of each node removed its latest fault (an older one
    on that node had no effect of its own), the earliest of those. Else, by the latest
    failure on a node in the job then (or on no node), else the latest of any: a fault
    whose node was out of the job (a hang while it rejoins) loses nobody. Else by a drain
    it shows (a draining node's members leave with the failure). `in_job` maps each
    agreed epoch's time to its members' nodes.

    Each fault explains or is absorbed by one epoch at most: a fault left unused because
    its effect came inside another's recovery would otherwise explain the next epoch it
    could fit, however much later, and time that recovery from its own injection."""
    planned = bool(a.get("planned"))
    admitted = {node_of(m) for m in _changed(a, "admitted", "admit")}
    removed = {node_of(m) for m in _changed(a, "removed", "drain" if planned else "lost")}
    before = [i for i in order if i not in used and faults[i].t <= float(a["t"])]

    def present(i: int) -> bool:
        node = faults[i].node
        return node is None or node in _nodes_at(in_job, faults[i].t)

    def shown(i: int) -> bool:
        fault = faults[i]
        if fault.effect is Effect.JOIN:
            return fault.node in admitted if fault.node else bool(admitted)
        if fault.effect is Effect.DRAIN:
            return fault.node in removed if fault.node else bool(removed) and planned
        return fault.node in removed and present(i)

    changes = [i for i in before if faults[i].effect is not Effect.FAILURE and shown(i)]
    failures = [] if planned else [i for i in before if faults[i].effect is Effect.FAILURE]
    latest = {faults[i].node: i for i in failures if shown(i)}  # per node: later ones win
    superseded = {i for i in failures if shown(i) and i not in latest.values()}
    tiers = (
        changes if planned else [i for i in failures if i in latest.values()],
        [i for i in reversed(failures) if present(i)],
        list(reversed(failures)),
        [i for i in changes if faults[i].effect is Effect.DRAIN],
    )
    chosen = next((tier[0] for tier in tiers if tier), None)
    absorbed = tuple(
        i
        for i in before
        if i != chosen and (i in latest.values() or (i in changes and faults[i].node))
    )
    used.update(absorbed, superseded, () if chosen is None else (chosen,))
    return chosen, absorbed


def _nodes_at(in_job: Mapping[float, frozenset[str]], t: float) -> frozenset[str]:
    """The nodes of the epoch in force at `t`: the last agreed at or before it (none
    before the first)."""
    agreed_by = [at for at in in_job if at <= t]
    return in_job[max(agreed_by)] if agreed_by else frozenset()


def phases(record: RecoveryRecord) -> tuple[Phase, ...]:
    """The phases laid end to end from the start: detect, agree, communicator, restore,
    replan, then first-step (what is left until the first commit: workers learning the
    epoch and computing the step). Durations are measured; positions are reconstructed,
    and clamped so that clock noise never pushes a phase past the end. A recovery still
    under way has a first-step of zero."""
    durations = (
        record.detect_s,
        record.agree_s,
        record.communicator_s,
        record.restore_s,
        record.replan_s,
    )
    end = None if record.end_t is None else max(record.end_t, record.start_t)
    out: list[Phase] = []
    cursor = record.start_t
    for name, seconds in zip(PHASES[:-1], durations, strict=True):
        nxt = cursor + max(seconds, 0.0)
        if end is not None:
            nxt = min(nxt, max(end, cursor))
        out.append(Phase(name, cursor, nxt))
        cursor = nxt
    out.append(Phase(PHASES[-1], cursor, cursor if end is None else max(end, cursor)))
    return tuple(out)
