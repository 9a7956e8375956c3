"""Scenario files: every shipped one parses; each mistake is reported with its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepstep.chaos.model import Fault, FaultKind, Trigger
from keepstep.chaos.scenario import ScenarioError, load_scenario, parse_scenario
from keepstep.chaos.schedule import expand
from keepstep.cli import main
from keepstep.launch.faults import FaultKind as LauncherKind
from keepstep.launch.faults import FaultSpec, parse_fault

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "e2e" / "scenarios").glob("*.yaml"))

GOOD = """\
name: demo
description: two faults
job:
  script: examples/mlp.py
  script_args: ["--sleep", "0.02"]
  nodes: 3
  global_batch: 48
  micro_batch: 4
  steps: 60
faults:
  - kind: kill-worker
    node: 1
    at: {step: 20}
  - kind: slow-node
    node: 2
    duration: 1.5
    cpu: 0.25
    at: {during_recovery_of: 0, delay: 0.1}
checks: {detection_bound_s: 8}
"""


def test_shipped_scenarios_parse_and_are_named_after_their_file() -> None:
    assert len(SCENARIOS) >= 12
    for path in SCENARIOS:
        scenario = load_scenario(path)
        assert scenario.name == path.stem
        assert (REPO / scenario.job.script).is_file()


def test_every_fault_kind_has_a_scenario() -> None:
    kinds = {f.kind for p in SCENARIOS for f in load_scenario(p).faults}
    assert kinds == set(FaultKind)


def test_the_launchers_kinds_are_taken_from_the_agent() -> None:
    """The chaos list holds every kind `keepstep run --fault` knows, by the same value, and
    hands those (at a step) to the launcher in its own spec syntax."""
    assert {k.value for k in LauncherKind} <= {k.value for k in FaultKind}
    for kind in FaultKind:
        own = kind.launcher_kind
        assert kind.launcher_native == (own is not None)
        if own is None:
            continue
        assert own.value == kind.value and kind.needs_node == own.needs_node
        node = 1 if kind.needs_node else None
        fault = Fault(kind, Trigger(step=7), node)
        assert fault.native and parse_fault(fault.spec()) == FaultSpec(own, node, 7)
    assert not FaultKind.SLOW_NODE.launcher_native
    assert FaultKind.RESTART_OPERATOR.launcher_kind is None


def test_a_good_file_becomes_frozen_dataclasses_with_lines() -> None:
    s = parse_scenario(GOOD, "demo.yaml")
    assert (s.job.nodes, s.job.steps, s.job.script_args) == (3, 60, ("--sleep", "0.02"))
    kill, slow = s.faults
    assert (kill.kind, kill.node, kill.at.step, kill.line) == (FaultKind.KILL_WORKER, 1, 20, 11)
    assert (slow.at.during_recovery_of, slow.at.delay, slow.cpu) == (0, 0.1, 0.25)
    assert s.checks.detection_bound_s == 8
    with pytest.raises(AttributeError):
        s.name = "other"  # type: ignore[misc]


def _error(text: str) -> ScenarioError:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "bad.yaml")
    return info.value


def test_a_typo_in_a_key_names_the_line_and_the_allowed_keys() -> None:
    error = _error(GOOD.replace("    node: 1\n", "    nod: 1\n"))
    assert error.line == 12
    assert str(error).startswith("bad.yaml:12: unknown key 'nod' in a fault")
    assert "did you mean 'node'?" in str(error)
    assert "allowed: kind, node, at" in str(error)


def test_an_unknown_fault_names_the_line_and_the_allowed_kinds() -> None:
    error = _error(GOOD.replace("kind: slow-node", "kind: melt-node"))
    assert error.line == 14
    assert "unknown fault kind 'melt-node'" in str(error)
    for kind in FaultKind:
        assert kind.value in str(error)


@pytest.mark.parametrize(
    ("edit", "line", "message"),
    [
        (("nodes: 3", "nodes: three"), 6, "expected an integer, got 'three'"),
        (("at: {step: 20}", "at: {step: 60}"), 11, "step 60 is not before steps 60"),
        (("at: {step: 20}", "at: {step: 2, time: 1}"), 13, "exactly one of step, time"),
        (("    duration: 1.5\n", ""), 14, "slow-node needs a duration"),
        (("cpu: 0.25", "cpu: 2"), 14, "cpu 2.0 must be in [0.05, 1)"),
        (("during_recovery_of: 0", "during_recovery_of: 1"), 14, "must name an earlier fault"),
        (("node: 2", "node: 7"), 14, "node 7 does not exist (0..2)"),
        (("  steps: 60\n", ""), 4, "job needs 'steps'"),
        (("detection_bound_s: 8", "detection_bound_s: -1"), 19, "must be > 0"),
        (("faults:", "faults: [}"), 10, "not valid YAML"),
    ],
)
def test_each_mistake_names_its_line(edit: tuple[str, str], line: int, message: str) -> None:
    error = _error(GOOD.replace(*edit))
    assert error.line == line, str(error)
    assert message in str(error)


def test_a_join_cannot_fire_by_time() -> None:
    text = GOOD.replace(
        "kind: kill-worker\n    node: 1\n    at: {step: 20}", "kind: join-node\n    at: {time: 3}"
    )
    assert "join-node fires at a step only" in str(_error(text))


def test_random_schedules_are_seeded_and_replayable() -> None:
    s = load_scenario(REPO / "e2e" / "scenarios" / "random-100.yaml")
    plans = expand(s)
    assert sum(len(p.faults) for p in plans) >= 100
    assert [p.faults for p in expand(s)] == [p.faults for p in plans]
    assert plans[0].faults != plans[1].faults
    for plan in plans:
        steps = [f.at.step for f in plan.faults if f.at.step is not None]
        assert steps == sorted(steps)
        # A steady node always remains: at most nodes - 1 faults take a node out for good.
        gone = {f.node for f in plan.faults if f.kind.removes_node and f.duration is None}
        assert len(gone) <= s.job.nodes - 1


def test_faults_referenced_by_a_later_one_go_to_the_injector() -> None:
    s = parse_scenario(
        GOOD.replace("kind: slow-node", "kind: kill-node").replace(
            "    duration: 1.5\n    cpu: 0.25\n", ""
        )
    )
    (plan,) = expand(s)
    assert plan.native_specs == ()
    assert [i for i, _ in plan.injected] == [0, 1]
    alone = parse_scenario(GOOD.replace("at: {during_recovery_of: 0, delay: 0.1}", "at: {time: 2}"))
    (plan,) = expand(alone)
    assert plan.native_specs == ("kill-worker:1@step=20",)
    assert [i for i, _ in plan.injected] == [1]


def test_the_command_line_reports_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(GOOD.replace("kind: kill-worker", "kind: kill-wroker"))
    assert main(["chaos", "run", str(path), "--run-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:11: unknown fault kind 'kill-wroker' (did you mean 'kill-worker'?)" in err
    assert not (tmp_path / "runs").exists()
