"""The figures of one system, from its ledgers and fault times, and the ratios between systems.

Pure functions of the final trajectories (harness/ledger.py) and the injected faults' wall
times; every figure is defined once here and used for all systems alike:

- step time: the interval between consecutive commits. Steady state = the median over
  full-world steps after the warm-up, in fault-free runs and before the first fault of
  faulty runs; samples/s = global batch / steady step time.
- MTTR of a failure: fault -> the commit of the first step attempt that started after it.
- join: `admitted_s` = injection -> the first commit with the full world again (includes
  starting the new process); `stall_s` = the longest commit gap meanwhile minus the steady
  step time (how long training stood still for it).
- throughput after losing 1 of N nodes: samples/s over the steps after the kill-node's
  recovery while the world is N - 1, over samples/s in the steady window before the first
  fault.
- goodput: samples trained exactly once per second, from the first commit to the last.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from harness.ledger import Ledger, StepEntry
from harness.stats import percentile


def intervals(entries: Sequence[StepEntry]) -> list[tuple[StepEntry, float]]:
    """(entry, time since the previous step's commit) for consecutive steps."""
    by_step = {e.step: e for e in entries}
    return [
        (e, e.t_commit - by_step[e.step - 1].t_commit) for e in entries if e.step - 1 in by_step
    ]


def steady_intervals(
    ledger: Ledger, warmup: int, full_world: int, before_t: float | None = None
) -> list[float]:
    return [
        dt
        for e, dt in intervals(ledger.entries)
        if e.step >= warmup
        and e.world == full_world
        and (before_t is None or e.t_commit < before_t)
    ]


def _rate(pairs: Sequence[tuple[StepEntry, float]]) -> float | None:
    time = sum(dt for _, dt in pairs)
    return sum(e.samples for e, _ in pairs) / time if pairs and time > 0 else None


def fault_outcomes(
    ledger: Ledger, faults: Sequence[dict[str, Any]], full_world: int, steady_s: float | None
) -> list[dict[str, Any]]:
    """One record per injected fault: MTTR for failures, admission and stall for joins."""
    entries = ledger.entries
    out = []
    for f in faults:
        t = float(f["t"])
        record: dict[str, Any] = {"kind": f["kind"], "node": f.get("node"), "step": f["step"]}
        if f["kind"] == "join-node":
            back = next((e for e in entries if e.t_start > t and e.world >= full_world), None)
            record["admitted_s"] = back.t_commit - t if back else None
            end = back.t_commit if back else max((e.t_commit for e in entries), default=t)
            gaps = [dt for e, dt in intervals(entries) if t < e.t_commit <= end]
            stall = max(gaps, default=0.0) - (steady_s or 0.0)
            record["stall_s"] = max(stall, 0.0) if back else None
        else:
            first = next((e for e in entries if e.t_start > t), None)
            record["mttr_s"] = first.t_commit - t if first else None
        out.append(record)
    return out


def throughput_after_loss(
    ledger: Ledger, faults: Sequence[dict[str, Any]], warmup: int, full_world: int
) -> dict[str, Any]:
    """Samples/s with one node fewer, over samples/s before the first fault.

    The stretch after the kill-node: from the first step after its recovery (that step's
    interval holds the recovery itself) while the world stays at full - 1 and no other
    failure has been injected, so it ends where the replacement is admitted or the next
    fault hits.
    """
    kill = next((f for f in faults if f["kind"] == "kill-node"), None)
    first_t = min((float(f["t"]) for f in faults), default=None)
    pairs = intervals(ledger.entries)
    before = _rate(
        [
            (e, dt)
            for e, dt in pairs
            if e.step >= warmup and e.world == full_world and first_t and e.t_commit < first_t
        ]
    )
    after_pairs: list[tuple[StepEntry, float]] = []
    if kill is not None:
        t_kill = float(kill["t"])
        t_next = min(
            (float(f["t"]) for f in faults if f["kind"] != "join-node" and float(f["t"]) > t_kill),
            default=float("inf"),
        )
        recovered = next((e for e in ledger.entries if e.t_start > t_kill), None)
        for e, dt in pairs:
            if recovered is None or e.step <= recovered.step:
                continue
            if e.world != full_world - 1 or e.t_commit > t_next:
                break
            after_pairs.append((e, dt))
    after = _rate(after_pairs)
    return {
        "before_samples_per_s": before,
        "after_samples_per_s": after,
        "after_steps": len(after_pairs),
        "fraction": after / before if after is not None and before else None,
    }


def goodput(ledger: Ledger) -> float | None:
    e = ledger.entries
    if len(e) < 2 or e[-1].t_commit <= e[0].t_commit:
        return None
    return sum(x.once_samples for x in e[1:]) / (e[-1].t_commit - e[0].t_commit)


def summarize_faults(
    outcomes: Sequence[dict[str, Any]], kinds: Sequence[str] = ()
) -> dict[str, Any]:
    """p50/p95 per kind over every fault of every repeat (every kind in `kinds`, even one
    with no outcome: a fault the job ended before)."""
    out: dict[str, Any] = {}
    for kind in sorted({*kinds, *(o["kind"] for o in outcomes)}):
        mine = [o for o in outcomes if o["kind"] == kind]
        if kind == "join-node":
            admitted = [o["admitted_s"] for o in mine if o["admitted_s"] is not None]
            stalls = [o["stall_s"] for o in mine if o["stall_s"] is not None]
            out[kind] = {
                "count": len(mine),
                "admitted": len(admitted),
                "admitted_p50_s": percentile(admitted, 0.5),
                "stall_p50_s": percentile(stalls, 0.5),
                "stall_p95_s": percentile(stalls, 0.95),
            }
        else:
            values = [o["mttr_s"] for o in mine if o["mttr_s"] is not None]
            out[kind] = {
                "count": len(mine),
                "recovered": len(values),
                "mttr_p50_s": percentile(values, 0.5),
                "mttr_p95_s": percentile(values, 0.95),
            }
    return out


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(figures: dict[str, dict[str, Any]], base: str = "keepstep") -> dict[str, Any]:
    """keepstep against each other system; each name says which way the ratio goes."""
    me = figures.get(base)
    if me is None:
        return {}
    out: dict[str, Any] = {}
    for other, f in figures.items():
        if other == base:
            continue
        mttr: dict[str, float | None] = {}
        for kind, mine in (me.get("faults") or {}).items():
            theirs = (f.get("faults") or {}).get(kind) or {}
            if "mttr_p50_s" in mine:
                mttr[kind] = div(theirs.get("mttr_p50_s"), mine["mttr_p50_s"])
        out[other] = {
            "step_time_keepstep_over_other": div(me["steady_step_s"], f["steady_step_s"]),
            "samples_per_s_keepstep_over_other": div(me["samples_per_s"], f["samples_per_s"]),
            "mttr_p50_other_over_keepstep": mttr,
            "throughput_after_loss_keepstep_over_other": div(
                (me.get("throughput_after_loss") or {}).get("fraction"),
                (f.get("throughput_after_loss") or {}).get("fraction"),
            ),
            "goodput_keepstep_over_other": div(
                me.get("goodput_samples_per_s"), f.get("goodput_samples_per_s")
            ),
        }
    return out
