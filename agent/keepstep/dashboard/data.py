"""What the dashboard shows, computed from a run's events: a pure function of its inputs.

`build_view(inputs, now)` turns the event logs (and, once the run ended, its summary)
into JSON-ready series: throughput and world size over time, what `step.log` recorded by
step (from the commits that stand, as in the run summary), one record per recovery with
its MTTR split into phases, and goodput. It works on a live run as well: the
recoveries are the fold the run summary is made of (`keepstep.agent.protocol.recovery`,
given the run's fault log once the launcher wrote it), applied to the events so far.
Times are seconds since training started (the first agreed epoch); `t0` is that moment
in wall-clock seconds.

Goodput is the share of the training window (first agreed epoch to last commit) not
lost to recoveries (fault to first commit after it) or to steps that were committed
and later rolled back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keepstep.agent.protocol import recovery
from keepstep.agent.protocol.events import EventKind
from keepstep.launch.summary import injected_faults, logged_metrics, standing_commits

# Intervals (distinct steps) the throughput line averages over: one slow step does not
# spike the line, and a change of world size shows within a few steps.
RATE_WINDOW = 4
# A run without a summary whose newest event is older than this has stopped reporting.
STALE_S = 60.0


@dataclass(frozen=True)
class RunInputs:
    name: str
    events: Sequence[Mapping[str, Any]]
    faults: Sequence[Mapping[str, Any]] = ()
    summary: Mapping[str, Any] | None = None
    steps_total: int | None = None


@dataclass(frozen=True)
class _Commit:
    t: float
    epoch: int
    step: int
    world_size: int
    samples: int
    step_s: float


def build_view(inputs: RunInputs, now: float) -> dict[str, Any]:
    events = sorted(inputs.events, key=lambda e: float(e["t"]))
    commits = _first_commits(events)
    agreed = [e for e in events if e["kind"] == EventKind.EPOCH_AGREED]
    t0 = float(agreed[0]["t"]) if agreed else (commits[0].t if commits else 0.0)
    status = _status(inputs, events, now)
    recoveries = _recoveries(inputs, events, t0)
    last_t = commits[-1].t if commits else t0
    final = _final_steps(commits)
    return {
        "run": inputs.name,
        "status": status,
        "t0": t0,
        "startup_s": t0 - float(events[0]["t"]) if events else 0.0,
        "step": max((c.step for c in commits), default=-1) + 1 if commits else 0,
        "steps_total": inputs.steps_total,
        "world_size": commits[-1].world_size if commits else 0,
        "params_sha256": (inputs.summary or {}).get("params_sha256"),
        "failures": _failures(inputs.summary),
        "throughput": _throughput(commits, t0),
        "world": {
            "t": [c.t - t0 for c in commits],
            "size": [c.world_size for c in commits],
            "step": [c.step for c in commits],
        },
        "metrics": _metrics(events),
        "recoveries": recoveries,
        "faults": [
            {**{k: f.get(k) for k in ("kind", "node", "step", "spec")}, "t": float(f["t"]) - t0}
            for f in inputs.faults
        ],
        "goodput": _goodput(commits, final, recoveries, t0, last_t),
        "mttr_p50_s": (inputs.summary or {}).get("mttr_p50_s", _median_mttr(recoveries)),
    }


def _failures(summary: Mapping[str, Any] | None) -> list[str]:
    """Why a finished run failed (the launcher's verdict); a summary written before the
    verdict existed fails when its workers reported different parameter digests."""
    if summary is None:
        return []
    if "failures" in summary:
        return [str(f) for f in summary["failures"] or []]
    disagree = summary.get("params_sha256_disagree") or []
    if not disagree:
        return []
    return [f"the workers finished with {len(disagree)} different parameter digests"]


def _status(inputs: RunInputs, events: Sequence[Mapping[str, Any]], now: float) -> str:
    if inputs.summary is not None:
        # A run that ended with disagreeing members (or a failed agent) is not "finished".
        return "failed" if _failures(inputs.summary) else "finished"
    if not events:
        return "starting"
    return "live" if now - float(events[-1]["t"]) < STALE_S else "stopped"


def _first_commits(events: Sequence[Mapping[str, Any]]) -> list[_Commit]:
    """One record per (epoch, step): its first commit, whichever member wrote it."""
    seen: dict[tuple[int, int], _Commit] = {}
    for e in events:
        if e["kind"] != EventKind.COMMIT:
            continue
        key = (int(e["epoch"]), int(e["step"]))
        if key in seen:
            continue
        mine = list(e.get("micro_batches", ()))
        per_micro = len(e.get("samples", ())) // len(mine) if mine else 0
        total = sum(len(ids) for ids in e.get("assignment", {}).values())
        seen[key] = _Commit(
            float(e["t"]),
            key[0],
            key[1],
            int(e["world_size"]),
            per_micro * total,
            float(e["step_s"]),
        )
    return sorted(seen.values(), key=lambda c: c.t)


def _final_steps(commits: Sequence[_Commit]) -> set[tuple[int, int]]:
    """The (epoch, step) commits that stand: a step's commit in its newest epoch."""
    newest: dict[int, int] = {}
    for c in commits:
        newest[c.step] = max(newest.get(c.step, -1), c.epoch)
    return {(e, s) for s, e in newest.items()}


def _metrics(events: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """Each logged name's value by step, from the commits that stand so far (a step redone
    after a rollback shows its redo). A value that is not finite is drawn as a gap: the
    browser's JSON parser takes no NaN or Infinity."""
    return {
        name: {
            "step": sorted(by_step),
            "value": [v if math.isfinite(v) else None for _, v in sorted(by_step.items())],
        }
        for name, by_step in logged_metrics(standing_commits(events)).items()
    }


def _throughput(commits: Sequence[_Commit], t0: float) -> dict[str, list[Any]]:
    t: list[float | None] = []
    rate: list[float | None] = []
    step: list[int | None] = []
    window: list[_Commit] = []
    for c in commits:
        if window and c.epoch != window[-1].epoch:
            # A recovery lies between: break the line rather than draw a slope across it.
            t.append(None)
            rate.append(None)
            step.append(None)
            window = []
        window = [*window, c][-(RATE_WINDOW + 1) :]
        if len(window) >= 2 and window[-1].t > window[0].t:
            samples = sum(w.samples for w in window[1:])
            t.append(c.t - t0)
            rate.append(samples / (window[-1].t - window[0].t))
            step.append(c.step)
    return {"t": t, "samples_per_s": rate, "step": step}


def _recoveries(
    inputs: RunInputs, events: Sequence[Mapping[str, Any]], t0: float
) -> list[dict[str, Any]]:
    # The summary holds the fault log too: a run directory may have it without faults.json.
    faults = inputs.faults or (inputs.summary or {}).get("faults") or ()
    out = []
    for index, r in enumerate(recovery.recoveries(events, injected_faults(faults))):
        tiled = recovery.phases(r)
        out.append(
            {
                "index": index + 1,
                "label": f"#{index + 1} {r.cause} {r.node or ''}".rstrip(),
                "cause": r.cause,
                "node": r.node,
                "epoch": r.epoch,
                "step": r.step,
                "start": r.start_t - t0,
                "end": (r.start_t - t0 + r.mttr_s) if r.mttr_s is not None else None,
                "mttr_s": r.mttr_s,
                "phases": {p.name: p.seconds for p in tiled},
                "rolled_back_steps": r.rolled_back_steps,
                "reason": r.reason,
            }
        )
    return out


def _goodput(
    commits: Sequence[_Commit],
    final: set[tuple[int, int]],
    recoveries: Sequence[Mapping[str, Any]],
    t0: float,
    last_t: float,
) -> dict[str, Any]:
    window = last_t - t0
    spans = sorted(
        (max(r["start"], 0.0), min(r["end"], window))
        for r in recoveries
        if r["end"] is not None and r["end"] > max(r["start"], 0.0)
    )
    lost_recovery, reach = 0.0, 0.0
    for a, b in spans:  # union of intervals: overlapping recoveries count once
        a = max(a, reach)
        if b > a:
            lost_recovery += b - a
        reach = max(reach, b)
    rolled = [c for c in commits if (c.epoch, c.step) not in final]
    lost_rolled = sum(c.step_s for c in rolled)
    useful = sum(c.samples for c in commits if (c.epoch, c.step) in final)
    fraction = max(window - lost_recovery - lost_rolled, 0.0) / window if window > 0 else None
    return {
        "fraction": fraction,
        "window_s": window,
        "recovery_s": lost_recovery,
        "rolled_back_s": lost_rolled,
        "rolled_back_commits": len(rolled),
        "useful_samples": useful,
        "useful_samples_per_s": useful / window if window > 0 else None,
    }


def _median_mttr(recoveries: Sequence[Mapping[str, Any]]) -> float | None:
    values = sorted(float(r["mttr_s"]) for r in recoveries if r["mttr_s"] is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
