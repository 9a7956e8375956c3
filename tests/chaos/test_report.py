"""The report: the JSON fields the issue names, and an HTML page that needs no network."""

from __future__ import annotations

import json
import re
from pathlib import Path

from keepstep.chaos import report
from keepstep.chaos.invariants import Observation, check, reference_from
from keepstep.chaos.model import Fault, FaultKind, Scenario, Trigger
from keepstep.chaos.runner import RunResult, ScenarioResult, summarize
from keepstep.chaos.schedule import RunPlan
from keepstep.chaos.target import RunOutcome

from .test_invariants import CHECKS, JOB, T0, make_run


def result(tmp_path: Path) -> ScenarioResult:
    ref_summary, ref_events = make_run()
    ref = reference_from(ref_summary, ref_events, JOB)
    summary, events = make_run({s: 1 for s in range(3, 6)})
    fault = Fault(FaultKind.KILL_WORKER, Trigger(step=3), node=1)
    applied = {
        "index": 0,
        "kind": "kill-worker",
        "node": "n1",
        "spec": "kill-worker:1@step=3",
        "via": "launcher",
        "t": T0 + 0.25,
        "step": 3,
        "skipped": None,
        "detail": {},
    }
    seen = Observation(0, T0 + 2, (applied,))
    outcome = RunOutcome(tmp_path / "run-000", summary, events, seen, T0 - 5)
    verdict = check(summary, events, ref, seen, JOB, CHECKS)
    scenario = Scenario("demo", JOB, (fault,), checks=CHECKS, description="a <demo>")
    plan = RunPlan(0, 0, (fault,))
    return ScenarioResult(scenario, "local", ref, [RunResult(plan, outcome, verdict)])


def test_the_json_has_the_fields_the_issue_names(tmp_path: Path) -> None:
    r = result(tmp_path)
    data = summarize(r)
    assert data["passed"] is True
    assert data["invariants"] == r.runs[0].verdict.invariants and all(data["invariants"].values())
    assert data["violations"] == []
    (fault,) = data["faults"]
    assert fault["spec"] == "kill-worker:1@step=3" and fault["t_s"] == 5.25
    (recovery,) = data["recoveries"]
    assert recovery["fault"] == 0 and recovery["detect_from_fault_s"] is not None
    assert data["goodput"]["ratio"] is not None
    json.dumps(data)  # serialisable as it is


def test_the_html_page_is_self_contained(tmp_path: Path) -> None:
    r = result(tmp_path)
    page = report.write(r, summarize(r), tmp_path / "out" / "demo.json")
    html = page.read_text()
    assert page == tmp_path / "out" / "demo.html"
    assert json.loads((tmp_path / "out" / "demo.json").read_text())["scenario"] == "demo"
    # plotly.js is inline: no script is fetched from anywhere.
    assert not re.search(r"<script[^>]+src=", html)
    assert "Plotly.newPlot" in html and len(html) > 1_000_000
    assert "a &lt;demo&gt;" in html and "every_recovery_recorded" in html
