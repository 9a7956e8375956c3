"""Every figure of one system, as the report holds it, and the issue's targets.

`system_figures` gathers, from a system's finished runs (harness.runs.Done: result and
ledger), the figures defined in harness/figures.py: steady step time, fault outcomes,
throughput after a node loss, the sample ledger, global batch per step, loss curves and
their deviation from the fault-free twin, parameter deviation (from the fault-free twin
and from the DDP run of the same round), goodput and the throughput timeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import figures as fig
from harness.config import BenchConfig, System
from harness.ledger import Ledger
from harness.params import max_abs_diff
from harness.runs import Done
from harness.schedule import make_schedule

# Every figure each system reports (None where it does not apply, as faults for DDP).
FIGURES = (
    "steady_step_s",
    "samples_per_s",
    "faults",
    "throughput_after_loss",
    "samples",
    "global_batch",
    "final_loss",
    "final_loss_fault_free",
    "final_loss_deviation",
    "loss_curve",
    "loss_curve_fault_free",
    "loss_curve_max_abs_deviation",
    "param_max_abs_deviation",
    "param_max_abs_deviation_vs_ddp",
    "goodput_samples_per_s",
    "goodput_vs_ddp",
    "timeline",
    "wall_s",
    "errors",
)


def _curve(led: Ledger) -> list[float | None]:
    by_step = {e.step: e.loss for e in led.entries}
    return [by_step.get(s) for s in range(max(by_step, default=-1) + 1)]


def _timeline(done: Done) -> dict[str, Any]:
    entries = done.ledger.entries
    if not entries:
        return {"t": [], "samples_per_s": [], "faults": []}
    t0 = entries[0].t_commit
    pairs = fig.intervals(entries)
    # Step k covers (previous commit, its commit] at samples / interval.
    return {
        "t_from": [round(e.t_commit - dt - t0, 4) for e, dt in pairs],
        "t": [round(e.t_commit - t0, 4) for e, _ in pairs],
        "samples_per_s": [round(e.samples / dt, 3) if dt > 0 else None for e, dt in pairs],
        "step": [e.step for e, _ in pairs],
        "faults": [
            {"kind": f["kind"], "t": round(float(f["t"]) - t0, 4), "step": f["step"]}
            for f in done.result.faults
        ],
    }


def _deviation(a: Path | None, b: Path | None) -> tuple[float | None, str | None]:
    if a is None or b is None or not a.is_file() or not b.is_file():
        return None, "final parameters missing"
    try:
        return max_abs_diff(a, b), None
    except (ValueError, RuntimeError, OSError) as error:
        return None, str(error)


def _first_fault_t(d: Done) -> float | None:
    return min((float(f["t"]) for f in d.result.faults), default=None)


def _steady(cfg: BenchConfig, system: System, faulty: list[Done], clean: list[Done]) -> list[float]:
    """Steady step intervals: fault-free runs, and faulty runs before their first fault.
    torchrun's own only (its fault-free twin is DDP, which does not checkpoint)."""
    out: list[float] = []
    if system is not System.TORCHRUN:
        for d in clean:
            out += fig.steady_intervals(d.ledger, cfg.warmup_steps, cfg.nodes)
    for d in faulty:
        out += fig.steady_intervals(d.ledger, cfg.warmup_steps, cfg.nodes, _first_fault_t(d))
    return out


def _fault_figures(cfg: BenchConfig, faulty: list[Done], steady_s: float | None) -> dict[str, Any]:
    w = cfg.workload
    schedule = make_schedule(cfg.schedule_seed, w.steps, cfg.nodes, cfg.warmup_steps)
    outcomes = [
        {**o, "repeat": d.planned.repeat}
        for d in faulty
        for o in fig.fault_outcomes(d.ledger, d.result.faults, cfg.nodes, steady_s)
    ]
    tal = [
        fig.throughput_after_loss(d.ledger, d.result.faults, cfg.warmup_steps, cfg.nodes)
        for d in faulty
    ]
    fractions = [t["fraction"] for t in tal if t["fraction"] is not None]
    return {
        "faults": fig.summarize_faults(outcomes, [f.kind.value for f in schedule]),
        "fault_outcomes": outcomes,
        "throughput_after_loss": {"fraction": fig.median(fractions), "per_run": tal},
        "faults_not_injected": {
            d.planned.label: d.result.extra["faults_not_injected"]
            for d in faulty
            if d.result.extra.get("faults_not_injected")
        },
    }


def _loss_figures(main: Done, twin: Done | None) -> dict[str, Any]:
    curve = _curve(main.ledger)
    out: dict[str, Any] = {"loss_curve": curve, "final_loss": curve[-1] if curve else None}
    if twin is None:
        return out
    ref = _curve(twin.ledger)
    out["loss_curve_fault_free"] = ref
    out["final_loss_fault_free"] = ref[-1] if ref else None
    if out["final_loss"] is not None and out["final_loss_fault_free"] is not None:
        out["final_loss_deviation"] = abs(out["final_loss"] - out["final_loss_fault_free"])
    diffs = [
        abs(a - b) for a, b in zip(curve, ref, strict=False) if a is not None and b is not None
    ]
    out["loss_curve_max_abs_deviation"] = max(diffs, default=None)
    return out


def _param_figures(runs: list[Done], refs: list[Done], ddp: list[Done]) -> dict[str, Any]:
    """Max abs parameter difference: each run against its round's fault-free reference
    (`refs`) and against that round's DDP run."""
    deviations: list[float] = []
    vs_ddp: list[float] = []
    notes: list[str] = []
    for d in runs:
        for pool, into in ((refs, deviations), (ddp, vs_ddp)):
            ref = next((c for c in pool if c.planned.repeat == d.planned.repeat), None)
            if ref is None or ref is d:
                continue
            value, note = _deviation(d.result.params, ref.result.params)
            if value is not None:
                into.append(value)
            elif note:
                notes.append(f"{d.planned.label} vs {ref.planned.label}: {note}")
    return {
        "param_max_abs_deviation": max(deviations, default=None),
        "param_max_abs_deviation_vs_ddp": max(vs_ddp, default=None),
        "param_notes": notes,
    }


def system_figures(
    cfg: BenchConfig, system: System, runs: list[Done], ddp: list[Done]
) -> dict[str, Any]:
    """Every figure of one system (its faulty runs, or its fault-free ones for DDP)."""
    w = cfg.workload
    faulty = [d for d in runs if d.planned.faulty]
    clean = [d for d in runs if not d.planned.faulty]
    refs = ddp if system is System.TORCHRUN else clean  # the fault-free twin of each round
    steady = _steady(cfg, system, faulty, clean)
    steady_s = fig.median(steady)
    out: dict[str, Any] = dict.fromkeys(FIGURES)
    out["steady_step_s"] = steady_s
    out["steady_steps_measured"] = len(steady)
    out["samples_per_s"] = w.global_batch / steady_s if steady_s else None
    out["errors"] = [f"{d.planned.label}: {d.result.error}" for d in runs if d.result.error]
    out["wall_s"] = {d.planned.label: round(d.result.wall_s, 1) for d in runs}
    main = faulty or clean
    if not main:
        return out
    if faulty:
        out.update(_fault_figures(cfg, faulty, steady_s))
    out["samples"] = {
        key: sum(getattr(d.ledger, key) for d in main)
        for key in ("expected", "seen_once", "lost", "duplicated", "beyond")
    }
    out["samples"]["missing_steps"] = sorted({s for d in main for s in d.ledger.missing_steps})
    if faulty and clean:
        out["samples_fault_free"] = {
            key: sum(getattr(d.ledger, key) for d in clean) for key in ("lost", "duplicated")
        }
    batches = [e.samples for e in main[0].ledger.entries]
    out["global_batch"] = {
        "configured": w.global_batch,
        "min": min(batches, default=None),
        "max": max(batches, default=None),
        "steps_below_configured": sum(1 for b in batches if b < w.global_batch),
        "per_step": batches,
    }
    twin = next((d for d in refs if d.planned.repeat == main[0].planned.repeat), None)
    out.update(_loss_figures(main[0], twin if faulty else None))
    out.update(_param_figures(faulty or main, refs if faulty else [], ddp))
    goodputs = [g for g in (fig.goodput(d.ledger) for d in main) if g is not None]
    out["goodput_samples_per_s"] = fig.median(goodputs)
    out["timeline"] = _timeline(main[0])
    return out


def step_time_ratio_by_round(cfg: BenchConfig, done: list[Done]) -> list[float | None]:
    """keepstep's steady step time over DDP's within each round. A round's runs are minutes
    apart, so the spread of these shows how far the machine drifted between rounds."""
    out = []
    for rep in range(cfg.repeats):
        ks = [d for d in done if d.planned.repeat == rep and d.planned.system is System.KEEPSTEP]
        ddp = [d for d in done if d.planned.repeat == rep and d.planned.system is System.DDP]
        faulty = [d for d in ks if d.planned.faulty]
        clean = [d for d in ks if not d.planned.faulty]
        ks_s = fig.median(_steady(cfg, System.KEEPSTEP, faulty, clean))
        out.append(fig.div(ks_s, fig.median(_steady(cfg, System.DDP, [], ddp))))
    return out


def targets(
    systems: dict[str, dict[str, Any]], step_ratio_by_round: list[float | None]
) -> dict[str, Any]:
    """The issue's targets, each a yes/no with the numbers it was decided on."""
    ks, tr, ft, ddp = (
        systems.get(s.value, {})
        for s in (System.KEEPSTEP, System.TORCHRUN, System.TORCHFT, System.DDP)
    )
    out: dict[str, Any] = {}
    mttr = {}
    for kind, f in (ks.get("faults") or {}).items():
        if "mttr_p50_s" in f:
            theirs = ((tr.get("faults") or {}).get(kind) or {}).get("mttr_p50_s")
            ratio = fig.div(theirs, f["mttr_p50_s"])
            mttr[kind] = {"torchrun_over_keepstep": ratio, "met": ratio is not None and ratio >= 10}
    out["mttr_10x_lower_than_torchrun"] = mttr
    ks_s, ft_s = ks.get("samples") or {}, ft.get("samples") or {}
    out["keepstep_no_lost_or_duplicated"] = (
        bool(ks_s) and not ks_s.get("lost") and not ks_s.get("duplicated")
    )
    out["torchft_loses_or_duplicates"] = bool(ft_s) and bool(
        ft_s.get("lost") or ft_s.get("duplicated")
    )
    ratio = fig.div(ks.get("steady_step_s"), ddp.get("steady_step_s"))
    out["keepstep_step_time_within_10pct_of_ddp"] = {
        "ratio": ratio,
        "met": ratio is not None and ratio <= 1.10,
        "ratio_by_round": step_ratio_by_round,
    }
    dev = ks.get("param_max_abs_deviation")
    out["keepstep_param_deviation_zero"] = {"value": dev, "met": dev == 0.0}
    return out
