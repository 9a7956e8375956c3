"""The report: the JSON fields the issue names, and an HTML page that needs no network."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from keepstep.chaos import report
from keepstep.chaos.invariants import Observation, check, reference_from
from keepstep.chaos.model import Fault, FaultKind, Scenario, Trigger
from keepstep.chaos.runner import (
    RunResult,
    ScenarioResult,
    attribute,
    refold,
    rejudged,
    summarize,
)
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


def test_recoveries_are_timed_from_the_fault_that_explains_them(tmp_path: Path) -> None:
    """Faults the launcher did not inject are timed too; a slowed node or a join applied
    before the failure does not take the credit for it."""
    summary, events = make_run({s: 1 for s in range(3, 6)})

    def applied(index: int, kind: str, t: float | None) -> dict[str, Any]:
        return {"index": index, "kind": kind, "node": "n1", "spec": f"{kind}:1@time=1s",
                "via": "injector", "t": t, "step": 3, "skipped": None, "detail": {}}  # fmt: skip

    faults = (
        applied(0, "join-node", T0 + 0.1),
        applied(1, "slow-node", T0 + 0.2),
        applied(2, "kill-node", None),  # skipped: never applied
        applied(3, "hang-node", T0 + 0.25),
    )
    seen = Observation(0, T0 + 2, faults)
    (recovery,) = attribute(RunOutcome(tmp_path / "run-000", summary, events, seen, T0 - 5))
    assert recovery["fault"] == 3
    assert recovery["detect_from_fault_s"] == pytest.approx(0.05)  # to the agreement
    assert recovery["mttr_from_fault_s"] == pytest.approx(0.15)  # to the first commit
    assert recovery["mttr_s"] == 0.2  # the summary's own figures are kept


def test_a_fault_whose_effect_came_inside_another_recovery_is_absorbed(tmp_path: Path) -> None:
    """Two nodes lost in one epoch: the earlier fault explains it, the other is timed by
    it too, and is not left over to explain (and mistime) a later recovery."""
    summary, events = make_run({s: 1 for s in range(3, 6)})
    for e in events:
        if e["kind"] == "epoch-agreed":
            e["removed"] = ["n1/0", "n2/0"]
    members = ["n0/0", "n1/0", "n2/0"]
    events.insert(0, {"t": T0 - 1, "kind": "epoch-agreed", "epoch": 0, "members": members})

    def applied(index: int, kind: str, node: str, t: float) -> dict[str, Any]:
        return {"index": index, "kind": kind, "node": node, "spec": f"{kind}:1@time=1s",
                "via": "injector", "t": t, "step": 3, "skipped": None, "detail": {}}  # fmt: skip

    faults = (applied(0, "kill-node", "n2", T0 + 0.2), applied(1, "kill-worker", "n1", T0 + 0.25))
    seen = Observation(0, T0 + 2, faults)
    (recovery,) = attribute(RunOutcome(tmp_path / "run-000", summary, events, seen, T0 - 5))
    assert recovery["fault"] == 0 and recovery["mttr_from_fault_s"] == pytest.approx(0.2)
    assert recovery["absorbed"] == [{"fault": 1, "mttr_from_fault_s": pytest.approx(0.15)}]


def test_a_report_is_folded_again_from_its_run_directories(tmp_path: Path) -> None:
    """`keepstep chaos check` folds the recoveries again from the runs' event logs (after
    the fold changed): the same logs give the same recoveries and tally."""
    r = result(tmp_path)
    (only,) = r.runs
    only.outcome.run_dir.mkdir(parents=True)
    (only.outcome.run_dir / "summary.json").write_text(json.dumps(only.outcome.summary))
    lines = "".join(json.dumps(e) + "\n" for e in only.outcome.events)
    (only.outcome.run_dir / "events-n0.jsonl").write_text(lines)
    data = json.loads(json.dumps(summarize(r), default=str))
    stale = data | {"recoveries": [], "by_kind": {}, "unexplained_recoveries": [{"run": 0}]}
    again = refold(stale, r.scenario)
    assert again["recoveries"] == data["recoveries"] and data["recoveries"][0]["fault"] == 0
    assert again["by_kind"] == data["by_kind"] and again["unexplained_recoveries"] == []


def test_check_write_puts_the_verdicts_found_now_into_the_report(tmp_path: Path) -> None:
    r = result(tmp_path)
    data = json.loads(json.dumps(summarize(r), default=str))
    assert data["passed"] and not data["violations"]
    held = r.runs[0].verdict
    broken = replace(
        held,
        invariants=held.invariants | {"clean_exit": False},
        violations=["clean_exit: agent n1 exited with 1"],
    )
    again = rejudged(data, [broken])
    assert not again["passed"]
    assert again["violations"] == ["run 0: clean_exit: agent n1 exited with 1"]
    assert again["invariants"]["clean_exit"] is False
    assert again["invariants"]["every_sample_once"] is True
    assert again["runs"][0]["violations"] == broken.violations
    assert data["passed"], "the report given is left as it was"
    assert rejudged(again, [held])["passed"]


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
