"""Faults by kind: how many were applied, how many landed inside a recovery, and the
recovery time of each kind (p50/p95), for the report of a long campaign.

Where it sits: `runner.summarize` adds `by_kind` to the report's JSON, and `report.py`
shows it as a table. A kind's label tells apart what the campaign counts as different
faults: a hang by SIGSTOP or by a frozen cgroup, and an etcd kill that takes one member of
three rather than the only etcd. Each fault is timed by the first recovery attributed to
it (`runner.attribute`), or that absorbed it (its effect came inside another fault's
recovery), from its injection to the first step committed after it.
`unexplained` lists the recoveries no fault explains that were not planned changes either:
a failure found where none was injected (a false detection) or a worker that left by
itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from keepstep.agent.protocol.recovery import Cause
from keepstep.chaos.model import Fault, FaultKind, Job

DURING_RECOVERY = "(inside a recovery)"


def label(fault: Fault, job: Job) -> str:
    if fault.kind is FaultKind.HANG_NODE:
        return f"hang-node/{fault.method or 'signal'}"
    if fault.kind is FaultKind.KILL_ETCD and job.etcd_members > 1:
        return "kill-etcd/member"
    return str(fault.kind.value)


def by_kind(
    plans: Mapping[int, Sequence[Fault]],
    job: Job,
    faults: Iterable[Mapping[str, Any]],
    recoveries: Iterable[Mapping[str, Any]],
) -> dict[str, dict[str, Any]]:
    """`plans`: each run's faults by run index; `faults` and `recoveries`: the report's
    lists (each entry names its `run`; a fault its `index`, a recovery the `fault` it
    followed). Returns one row per label, sorted, plus one for faults inside a recovery."""
    first: dict[tuple[int, int], Mapping[str, Any]] = {}
    for rec in recoveries:
        # A fault absorbed by another's recovery is timed by it, with no detection of its own.
        entries = [rec, *({"epoch": rec["epoch"], **a} for a in rec.get("absorbed", ()))]
        for entry in entries:
            if entry.get("fault") is None or entry.get("mttr_from_fault_s") is None:
                continue
            key = (int(rec["run"]), int(entry["fault"]))
            if key not in first or int(entry["epoch"]) < int(first[key]["epoch"]):
                first[key] = entry
    rows: dict[str, dict[str, Any]] = {}
    samples: dict[str, tuple[list[float], list[float]]] = {}
    for f in faults:
        run, index = int(f["run"]), int(f["index"])
        fault = plans[run][index]
        names = [label(fault, job)]
        if fault.at.during_recovery_of is not None:
            names.append(DURING_RECOVERY)
        applied = f.get("t") is not None
        timed = first.get((run, index))
        for name in names:
            row = rows.setdefault(name, {"applied": 0, "skipped": 0, "recovered": 0})
            row["applied" if applied else "skipped"] += 1
            if timed is not None:
                row["recovered"] += 1
                detect, mttr = samples.setdefault(name, ([], []))
                mttr.append(float(timed["mttr_from_fault_s"]))
                if timed.get("detect_from_fault_s") is not None:
                    detect.append(float(timed["detect_from_fault_s"]))
    for name, row in rows.items():
        detect, mttr = samples.get(name, ([], []))
        row["detect_p50_s"] = _quantile(detect, 0.5)
        row["mttr_p50_s"] = _quantile(mttr, 0.5)
        row["mttr_p95_s"] = _quantile(mttr, 0.95)
        row["mttr_max_s"] = max(mttr) if mttr else None
    return dict(sorted(rows.items()))


# Changes that need no fault of their own: admissions, returns and drains, and the epochs
# that admit a worker for sharded state an earlier fault left missing (its recovery goes on).
_PLANNED = frozenset({Cause.JOIN, Cause.REJOIN, Cause.DRAIN, Cause.PLANNED, Cause.MISSING_STATE})


def unexplained(recoveries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The report's recoveries (attributed, each naming its `run`) that followed no fault
    and were no planned change: run, epoch, cause and reason of each."""
    return [
        {k: rec.get(k) for k in ("run", "epoch", "cause", "reason")}
        for rec in recoveries
        if rec.get("fault") is None and rec.get("cause") not in _PLANNED
    ]


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[round(q * 100) - 1] if q < 1 else max(values)
