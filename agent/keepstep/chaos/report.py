"""The chaos report: JSON for machines, and one self-contained HTML page for people.

Where it sits: the last step of `keepstep chaos run`. The JSON is `runner.summarize`'s
dict (`invariants: {name: bool}`, `violations`, `faults`, `recoveries`, `goodput`, runs).
The HTML page carries plotly.js inline (plotly's own offline bundle), so it opens without
a network: per run, progress over time with the faults marked, world size by step and
each recovery's phases; then goodput per run against the fault-free run.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from keepstep.agent.protocol.events import EventKind
from keepstep.agent.protocol.recovery import PHASES
from keepstep.chaos.runner import RunResult, ScenarioResult

_PHASES = tuple(f"{p}_s" for p in PHASES[:-1])  # the summary's phase fields


def write(result: ScenarioResult, data: dict[str, Any], path: Path) -> Path:
    """Write the JSON to `path` and the HTML page beside it; return the page's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
    page = path.with_suffix(".html")
    page.write_text(render(result, data))
    return page


def render(result: ScenarioResult, data: dict[str, Any]) -> str:
    parts = [_header(data)]
    for run in result.runs:
        parts.append(f"<h2>Run {run.plan.index} (seed {run.plan.seed})</h2>")
        parts.append(_run_table(run))
        for fig in (_progress(run), _world(run), _recoveries(run)):
            if fig is not None:
                parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
    if len(result.runs) > 1:
        parts.append(_goodput(result).to_html(full_html=False, include_plotlyjs=False))
    title = html.escape(f"keepstep chaos: {data['scenario']}")
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
        "td,th{padding:2px 8px;text-align:left}.ok{color:#080}.bad{color:#b00}</style>"
        f"</head><body>{''.join(parts)}</body></html>"
    )


def _header(data: dict[str, Any]) -> str:
    if data.get("skipped"):
        verdict = f"<p class='bad'>SKIPPED: {html.escape(data['skipped'])}</p>"
    elif data["passed"]:
        verdict = "<p class='ok'>PASSED: every invariant held in every run</p>"
    else:
        verdict = "<p class='bad'>FAILED</p>"
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td class='{'ok' if ok else 'bad'}'>"
        f"{'holds' if ok else 'VIOLATED'}</td></tr>"
        for name, ok in data["invariants"].items()
    )
    g = data["goodput"]
    ratio = f"{g['ratio']:.3f}" if g.get("ratio") else "-"
    known = (
        f"<p><b>Known finding:</b> {html.escape(data['known_failure'])}</p>"
        if data.get("known_failure")
        else ""
    )
    violations = "".join(f"<li>{html.escape(v)}</li>" for v in data["violations"][:200])
    late = data.get("fault_step_error_max")
    late_text = "" if late is None else f"; step faults landed at most {late} steps late"
    return (
        f"<h1>{html.escape(data['scenario'])} ({html.escape(data['target'])})</h1>"
        f"<p>{html.escape(data.get('description') or '')}</p>{verdict}{known}"
        f"<p>{data['faults_applied']} faults applied, {data['faults_skipped']} skipped, "
        f"{len(data['recoveries'])} recoveries "
        f"({len(data.get('unexplained_recoveries') or [])} that no fault explains); "
        f"goodput {ratio} of the fault-free run"
        f"{late_text}</p>"
        f"<table><tr><th>invariant</th><th></th></tr>{rows}</table>"
        + (f"<h3>Violations</h3><ul>{violations}</ul>" if violations else "")
        + _kinds_table(data.get("by_kind") or {})
    )


def _kinds_table(kinds: dict[str, dict[str, Any]]) -> str:
    if not kinds:
        return ""

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{k['applied']}</td><td>{k['skipped']}</td>"
        f"<td>{k['recovered']}</td><td>{s(k['detect_p50_s'])}</td><td>{s(k['mttr_p50_s'])}</td>"
        f"<td>{s(k['mttr_p95_s'])}</td></tr>"
        for name, k in kinds.items()
    )
    return (
        "<h3>Faults by kind</h3><table><tr><th>kind</th><th>applied</th><th>skipped</th>"
        "<th>timed recoveries</th><th>detect p50 s</th><th>MTTR p50 s</th>"
        f"<th>MTTR p95 s</th></tr>{rows}</table>"
    )


def _run_table(run: RunResult) -> str:
    start = run.outcome.started_t
    rows = []
    for f in run.outcome.seen.faults:
        t = f.get("t")
        when = f"{t - start:.2f} s, step {f.get('step')}" if t else "-"
        scheduled = f.get("scheduled_step")
        if t and scheduled is not None and scheduled != f.get("step"):
            when += f" (scheduled {scheduled})"
        rows.append(
            f"<tr><td>#{f['index']}</td><td>{html.escape(f['spec'])}</td><td>{f['via']}</td>"
            f"<td>{when}</td><td>{html.escape(f.get('skipped') or '')}</td>"
            f"<td>{html.escape(json.dumps(f.get('detail') or {}))}</td></tr>"
        )
    return (
        "<table><tr><th></th><th>fault</th><th>by</th><th>applied</th><th>skipped</th>"
        f"<th>detail</th></tr>{''.join(rows)}</table>"
    )


def _progress(run: RunResult) -> go.Figure:
    start = run.outcome.started_t
    # One point per step and epoch (its first commit): members commit a step together.
    firsts: dict[tuple[int, int], dict[str, Any]] = {}
    for e in run.outcome.events:
        if e["kind"] == EventKind.COMMIT:
            firsts.setdefault((e["step"], e["epoch"]), e)
    commits = sorted(firsts.values(), key=lambda e: float(e["t"]))
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(  # not Scattergl: the page must render without WebGL too
            x=[e["t"] - start for e in commits],
            y=[e["step"] for e in commits],
            mode="markers",
            marker={"size": 3},
            name="commits",
            text=[f"epoch {e['epoch']}, world {e['world_size']}" for e in commits],
        )
    )
    for f in run.outcome.seen.faults:
        if f.get("t"):
            fig.add_vline(x=f["t"] - start, line={"color": "red", "dash": "dot"})
            fig.add_annotation(x=f["t"] - start, y=1, yref="paper", text=f["kind"], showarrow=False)
    for e in run.outcome.events:
        if e["kind"] == EventKind.EPOCH_AGREED and e.get("epoch", 0) > 0:
            fig.add_vline(x=e["t"] - start, line={"color": "green", "width": 1})
    fig.update_layout(
        title="committed steps over time (red: faults, green: new epochs)",
        xaxis_title="seconds since the run started",
        yaxis_title="step",
        height=350,
    )
    return fig


def _world(run: RunResult) -> go.Figure | None:
    sizes = (run.outcome.summary or {}).get("world_size_by_step")
    if not sizes:
        return None
    fig = go.Figure(go.Scatter(y=sizes, mode="lines", line={"shape": "hv"}))
    fig.update_layout(title="world size by step", xaxis_title="step", height=250)
    return fig


def _recoveries(run: RunResult) -> go.Figure | None:
    recs = (run.outcome.summary or {}).get("recoveries") or []
    if not recs:
        return None
    labels = [f"e{r['epoch']} {r['cause']} {r.get('node') or ''}" for r in recs]
    fig = go.Figure([go.Bar(name=p, x=labels, y=[r.get(p) or 0 for r in recs]) for p in _PHASES])
    fig.add_trace(
        go.Scatter(name="mttr_s", x=labels, y=[r.get("mttr_s") for r in recs], mode="markers")
    )
    fig.update_layout(barmode="stack", title="recovery phases (s)", height=300)
    return fig


def _goodput(result: ScenarioResult) -> go.Figure:
    ratios = [r.verdict.goodput.get("ratio") for r in result.runs]
    fig = go.Figure(go.Bar(x=[f"run {r.plan.index}" for r in result.runs], y=ratios))
    target = result.scenario.checks.min_goodput
    if target:
        fig.add_hline(y=target, line={"color": "red", "dash": "dot"})
    fig.update_layout(title="goodput per run / fault-free run", height=300)
    return fig
