"""Each fault kind's scenario, run in local mode: every invariant holds (or the scenario is
skipped with its reason).

The shipped scenario files run as they are; they share one job, so one fault-free
reference run (cached for the session) serves them all. Run them one at a time on a
small machine: each is one `keepstep run` of three nodes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from keepstep.chaos.local import PARTITION_SKIP, LocalTarget
from keepstep.chaos.runner import ScenarioResult, recheck, run_scenario, summarize
from keepstep.chaos.scenario import load_scenario
from keepstep.chaos.schedule import expand
from keepstep.launch import netns

# Each run is one `keepstep run` of three nodes (about a minute on a busy 2-core machine);
# the first one of a session also runs the fault-free reference.
slow = [pytest.mark.slow, pytest.mark.timeout(300)]

SCENARIOS = Path(__file__).resolve().parents[2] / "e2e" / "scenarios"
PASSING = [
    "kill-worker",
    "kill-node",
    "hang-node",
    "drain-node",
    "join-node",
    "slow-node",
    "corrupt-snapshot",
    "etcd-restart",
    "kill-etcd",  # one of three etcd members, for good
    "fault-during-recovery",
    "hang-resume",  # its own four-node job: a second reference run
    "slow-all",  # every node slowed at once: nobody may be taken for hung
]


@pytest.fixture(scope="session")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-reference")


# A partition needs every node in a network namespace of its own: root and `ip`.
NETNS_MISSING = netns.missing(os.geteuid(), shutil.which("ip"))


def run(
    name: str, tmp_path: Path, cache: Path, target: LocalTarget | None = None
) -> ScenarioResult:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    target = target or LocalTarget()
    return run_scenario(scenario, target, tmp_path / name, cache, say=lambda _: None)


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
    # A fault at a step lands at that step, the job held at its boundary meanwhile, whether
    # the launcher or the injector applies it.
    for fault in faults:
        if fault["scheduled_step"] is not None:
            assert fault["step"] == fault["scheduled_step"] and fault["held"], fault
    assert data["fault_step_error_max"] in (0, None)
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
    if name == "kill-etcd":  # the leader went, and the worker kill after it was recovered
        etcd_kill, worker_kill = faults
        assert etcd_kill["detail"]["leader"] is True, etcd_kill["detail"]
        assert worker_kill["t"] > etcd_kill["t"]
        causes = [(r["cause"], r["node"]) for r in summary["recoveries"]]
        # Recovered from (every_recovery_recorded matched the kill to a recovery): found by
        # n1's agent (its worker's exit) or first by a survivor's failed collective; the
        # restarted worker's return is a recovery of its own (rejoin).
        assert any(c in ("worker-exit", "collective") for c, _ in causes), causes
    if name == "etcd-restart":
        (fault,) = faults
        assert fault["detail"]["chosen"] == "the run's only etcd"


@pytest.mark.skipif(NETNS_MISSING is None, reason="root with `ip`: the partition runs")
def test_partition_is_skipped_with_its_reason(tmp_path: Path, reference_cache: Path) -> None:
    result = run("partition-node", tmp_path, reference_cache)
    assert result.skipped == PARTITION_SKIP + str(NETNS_MISSING) and result.runs == []


def test_partition_skip_names_what_is_missing(tmp_path: Path, reference_cache: Path) -> None:
    unprivileged = LocalTarget(euid=1000, ip=None)
    result = run("partition-node", tmp_path, reference_cache, unprivileged)
    assert result.runs == [] and result.skipped is not None
    assert result.skipped.startswith(PARTITION_SKIP)
    assert "root (running as uid 1000)" in result.skipped and "`ip` command" in result.skipped


def test_only_a_run_with_a_partition_asks_for_namespaces(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "partition-node.yaml")
    (plan,) = expand(scenario)
    (kill,) = expand(load_scenario(SCENARIOS / "kill-node.yaml"))
    ip = tmp_path / "ip"  # never run: the target only needs to find it
    ip.write_text("#!/bin/sh\nexit 1\n")
    ip.chmod(0o755)
    able = LocalTarget(euid=0, ip=str(ip))
    assert "--netns" in able.command(scenario.job, plan, tmp_path)
    assert "--netns" not in able.command(scenario.job, None, tmp_path)  # the reference
    assert "--netns" not in able.command(scenario.job, kill, tmp_path)
    unable = LocalTarget(euid=1000, ip=str(ip))
    assert "--netns" not in unable.command(scenario.job, plan, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(NETNS_MISSING is not None, reason=f"partition-node needs {NETNS_MISSING}")
def test_partitioned_node_is_excluded_then_readmitted_with_every_invariant(
    tmp_path: Path, reference_cache: Path
) -> None:
    """The fault-free reference runs without namespaces: the numbers do not depend on them."""
    result = run("partition-node", tmp_path, reference_cache)
    assert result.skipped is None
    (only,) = result.runs
    assert only.verdict.passed and not only.verdict.violations, only.verdict.violations
    assert all(only.verdict.invariants.values()), only.verdict.invariants
    (fault,) = only.outcome.seen.faults
    assert fault["t"] is not None and fault["detail"]["method"] == "veth-down"
    run_dir = only.outcome.run_dir
    loaded = netns.load_plan(run_dir)
    assert loaded is not None and fault["detail"]["veth"] == loaded[0].node(1).host_veth
    summary = only.outcome.summary
    assert summary is not None
    # Lost when it missed its heartbeats (or its lease expired first), trained on without
    # it, admitted again once reachable.
    # The first detection may come from either side of the cut: n1's own agent misses its
    # neighbours' heartbeats as they miss its.
    causes = [(r["cause"], r["node"]) for r in summary["recoveries"]]
    assert causes[0][0] in {"heartbeat-missed", "lease-expired"}, causes
    assert causes[-1][0] == "rejoin", causes
    sizes = summary["world_size_by_step"]
    assert min(sizes) == 2 and sizes[-1] == 3
    assert summary["agent_exit_codes"] == {"n0": 0, "n1": 0, "n2": 0}


def test_restart_operator_is_for_cluster_mode(tmp_path: Path, reference_cache: Path) -> None:
    result = run("restart-operator", tmp_path, reference_cache)
    assert result.skipped is not None and "cluster mode" in result.skipped
