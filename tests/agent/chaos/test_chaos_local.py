"""Each fault kind's scenario, run in local mode: every invariant holds (or the scenario is
skipped with its reason, or it demonstrates its documented finding).

The shipped scenario files run as they are; they share one job, so one fault-free
reference run (cached for the session) serves them all. Run them one at a time on a
small machine: each is one `keepstep run` of three nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keepstep.agent.chaos.local import PARTITION_SKIP, LocalTarget
from keepstep.agent.chaos.runner import ScenarioResult, recheck, run_scenario, summarize
from keepstep.agent.chaos.scenario import load_scenario

# Each run is one `keepstep run` of three nodes (about a minute on a busy 2-core machine);
# the first one of a session also runs the fault-free reference.
slow = [pytest.mark.slow, pytest.mark.timeout(300)]

SCENARIOS = Path(__file__).resolve().parents[3] / "e2e" / "scenarios"
PASSING = [
    "kill-worker",
    "kill-node",
    "hang-node",
    "drain-node",
    "join-node",
    "slow-node",
    "corrupt-snapshot",
    "etcd-restart",
    "fault-during-recovery",
    "hang-resume",  # its own four-node job: a second reference run
]


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-reference")


def run(name: str, tmp_path: Path, cache: Path) -> ScenarioResult:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    return run_scenario(scenario, LocalTarget(), tmp_path / name, cache, say=lambda _: None)


@pytest.mark.parametrize("name", [pytest.param(n, marks=slow) for n in PASSING])
def test_scenario_keeps_every_invariant(name: str, tmp_path: Path, reference_cache: Path) -> None:
    result = run(name, tmp_path, reference_cache)
    (only,) = result.runs
    faults = only.outcome.seen.faults
    assert faults and all(f["t"] is not None for f in faults), faults
    assert only.verdict.passed and not only.verdict.violations, only.verdict.violations
    # The report holds what it takes to judge the run again.
    data = json.loads(json.dumps(summarize(result), default=str))
    assert data["passed"] and data["invariants"] == only.verdict.invariants
    assert [v.invariants for v in recheck(data, result.scenario)] == [only.verdict.invariants]
    summary = only.outcome.summary
    assert summary is not None
    if name == "corrupt-snapshot":
        (fault,) = faults
        assert fault["detail"]["corrupted"] and fault["detail"]["store_refuses_slot"]
    if name == "slow-node":
        assert summary["recoveries"] == []  # slow is not lost
    if name in ("kill-node", "hang-node", "drain-node"):
        assert min(summary["world_size_by_step"]) < 3
    if name == "hang-resume":  # each stopped node was excluded, then admitted again
        sizes = summary["world_size_by_step"]
        assert min(sizes) == 3 and sizes[-1] == 4
        assert sum(r["cause"] == "rejoin" for r in summary["recoveries"]) == 3
    if name == "join-node":
        assert max(summary["world_size_by_step"]) == 4


def test_partition_is_skipped_with_its_reason(tmp_path: Path, reference_cache: Path) -> None:
    result = run("partition-node", tmp_path, reference_cache)
    assert result.skipped == PARTITION_SKIP and result.runs == []


def test_restart_operator_is_for_cluster_mode(tmp_path: Path, reference_cache: Path) -> None:
    result = run("restart-operator", tmp_path, reference_cache)
    assert result.skipped is not None and "cluster mode" in result.skipped


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_losing_the_only_etcd_is_a_documented_finding(
    tmp_path: Path, reference_cache: Path
) -> None:
    """Kept out of the passing set (see kill-etcd.yaml's known_failure): when this starts
    to pass, the finding is fixed; move it into PASSING. (hang-during-recovery.yaml, the
    other finding, depends on a race and is not asserted here.)"""
    result = run("kill-etcd", tmp_path, reference_cache)
    assert result.scenario.known_failure
    (only,) = result.runs
    verdict = only.verdict.invariants
    assert not result.passed
    # The fault the job could not recover from is reported as such ...
    assert not verdict["every_recovery_recorded"]
    # ... and the harness still ends every process of the run.
    assert verdict["no_process_left_behind"]
