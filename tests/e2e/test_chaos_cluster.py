"""Chaos scenarios in cluster mode: the shipped scenario files, unchanged, run as TrainJobs
on a real control plane with process-backed nodes and the real operator, and keep every
invariant that local mode checks (parameters equal to the fault-free run's, global batch,
every sample once, no hang, nothing left behind, every recovery recorded, clean exit).

The fast tests check the pieces that need no cluster: the TrainJob a scenario's job
becomes, the summary built from agents' event logs, the cluster's size, the skips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.chaos.local import LocalTarget
from keepstep.chaos.model import FaultKind, Job
from keepstep.chaos.runner import ScenarioResult, recheck, run_scenario, summarize
from keepstep.chaos.scenario import load_scenario
from keepstep.chaos.schedule import expand
from keepstep.e2e.chaos_cluster import PARTITION_SKIP, ClusterTarget, nodes_needed
from keepstep.e2e.chaos_env import ChaosCluster
from keepstep.e2e.chaos_trainjob import job_problems, run_summary, trainjob_manifest
from keepstep.e2e.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = REPO / "e2e" / "scenarios"


def scenario_job(**changes: Any) -> Job:
    fields: dict[str, Any] = dict(
        script="examples/mlp.py", nodes=3, global_batch=48, micro_batch=4, steps=20
    )
    return Job(**(fields | changes))


# -- without a cluster ------------------------------------------------------------------


def test_the_trainjob_trains_the_scenarios_job(tmp_path: Path) -> None:
    job = scenario_job(script_args=("--sleep", "0.02"), min_nodes=2, seed=5, checkpoint_every=5)
    m = trainjob_manifest(job, "run-000-ab12", joins=1, tmpdir=tmp_path, checkpoints=tmp_path)
    trainer, policy = m["spec"]["trainer"], m["spec"]["elasticPolicy"]
    assert trainer["command"][1] == str(REPO / "examples" / "mlp.py")
    assert trainer["args"] == ["--sleep", "0.02"]
    assert (trainer["numNodes"], trainer["numSteps"], trainer["seed"]) == (3, 20, 5)
    assert trainer["env"] == [{"name": "TMPDIR", "value": str(tmp_path)}]
    assert policy == {"minNodes": 2, "maxNodes": 4, "globalBatchSize": 48, "microBatchSize": 4}
    assert m["spec"]["checkpoint"] == {"uri": tmp_path.as_uri(), "everySteps": 5}
    plain = trainjob_manifest(scenario_job(), "x", joins=0, tmpdir=tmp_path, checkpoints=None)
    assert "checkpoint" not in plain["spec"]


def test_a_job_a_trainjob_cannot_express_is_refused_with_the_reason() -> None:
    assert job_problems(scenario_job()) == []
    (fast,) = job_problems(scenario_job(mode="fast"))
    assert "mode 'fast'" in fast
    (hang,) = job_problems(scenario_job(hang_timeout=3))
    assert "hang_timeout 3" in hang


def test_the_cluster_has_a_free_node_for_each_pod_a_fault_takes_out() -> None:
    kill = load_scenario(SCENARIOS / "kill-node.yaml")
    assert nodes_needed(kill.job, expand(kill)) == 4
    operator = load_scenario(SCENARIOS / "restart-operator.yaml")
    assert nodes_needed(operator.job, expand(operator)) == 4  # one spare all the same
    hang = load_scenario(SCENARIOS / "hang-node.yaml")
    assert nodes_needed(hang.job, expand(hang)) == 5


def test_the_summary_credits_only_faults_that_change_the_membership() -> None:
    job = scenario_job(steps=1, global_batch=8, micro_batch=4, nodes=2)
    assignment = {"a/0": [0], "b/0": [1]}
    events: list[dict[str, Any]] = [
        {"kind": "epoch-agreed", "epoch": 1, "t": 5.0, "planned": False, "members": ["a/0"]},
    ]
    for member in ("a/0", "b/0"):
        events.append(
            {
                "kind": "commit",
                "t": 6.0,
                "step": 0,
                "epoch": 1,
                "member": member,
                "world_size": 2,
                "assignment": assignment,
                "micro_batches": assignment[member],
            }
        )
        events.append(
            {"kind": "finish", "t": 7.0, "member": member, "done": 1, "params_sha256": "s"}
        )
    applied: list[dict[str, Any]] = [
        {"kind": "restart-operator", "node": None, "t": 1.0},
        {"kind": "kill-node", "node": "b", "t": 4.0},
        {"kind": "kill-worker", "node": "a", "t": None, "skipped": "no worker"},
    ]
    summary = run_summary(events, applied, job, {"a": 0})
    (recovery,) = summary["recoveries"]
    assert (recovery["cause"], recovery["node"], recovery["mttr_s"]) == ("kill-node", "b", 2.0)
    assert summary["agent_exit_codes"] == {"a": 0}
    assert summary["params_sha256"] == "s" and summary["samples"]["lost"] == 0


def test_partition_is_skipped_in_cluster_mode_without_starting_a_cluster(tmp_path: Path) -> None:
    def no_cluster() -> ChaosCluster:
        raise AssertionError("a skipped scenario must not start a cluster")

    target = ClusterTarget(no_cluster)
    assert set(target.unsupported()) == {FaultKind.PARTITION_NODE, FaultKind.KILL_ETCD}
    scenario = load_scenario(SCENARIOS / "partition-node.yaml")
    result = run_scenario(scenario, target, tmp_path, say=lambda _: None)
    assert result.skipped == PARTITION_SKIP and result.runs == []
    assert target.started is None


# -- on the cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, jobs_etcd: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChaosCluster]:
    """Four nodes: the job's three and one for the pod that replaces a lost one."""
    made = ChaosCluster.on(control_plane, jobs_etcd, tmp_path_factory.mktemp("chaos-nodes"), 4)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-reference")


def run(name: str, cluster: ChaosCluster, tmp_path: Path, cache: Path) -> ScenarioResult:
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    target = ClusterTarget(cluster)
    return run_scenario(
        scenario, target, tmp_path / name, cache, say=print, reference_target=LocalTarget()
    )


def passed(result: ScenarioResult) -> dict[str, Any]:
    """The run's verdict holds everywhere, and the report judges it the same again."""
    (only,) = result.runs
    cluster_txt = (only.outcome.run_dir.parents[2] / "cluster.txt").read_text()
    assert only.verdict.passed and not only.verdict.violations, (
        f"{only.verdict.violations}\n{cluster_txt}"
    )
    data = json.loads(json.dumps(summarize(result), default=str))
    assert data["passed"] and data["target"] == "cluster"
    assert [v.invariants for v in recheck(data, result.scenario)] == [only.verdict.invariants]
    summary = only.outcome.summary
    assert summary is not None
    return summary


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)  # a local reference run, then a TrainJob and its pods' start
def test_kill_node_keeps_every_invariant_on_the_cluster(
    cluster: ChaosCluster, tmp_path: Path, reference_cache: Path
) -> None:
    result = run("kill-node", cluster, tmp_path, reference_cache)
    (only,) = result.runs
    (fault,) = only.outcome.seen.faults
    assert fault["t"] is not None and fault["node"].endswith("-node-2"), fault
    assert fault["detail"]["k8s_node"] in cluster.runners
    assert fault["detail"]["snapshots_lost"] == 1  # its memory went with it
    summary = passed(result)
    assert min(summary["world_size_by_step"]) == 2, summary["world_size_by_step"]
    (first, *_rest) = summary["recoveries"]
    assert (first["cause"], first["node"]) == ("kill-node", fault["node"])
    # The killed node was rebooted for the next run.
    assert not cluster.killed and all(r.running() for r in cluster.runners.values())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)  # a local reference run, then a TrainJob and its pods' start
def test_restart_operator_keeps_every_invariant_and_training_never_notices(
    cluster: ChaosCluster, tmp_path: Path, reference_cache: Path
) -> None:
    result = run("restart-operator", cluster, tmp_path, reference_cache)
    (only,) = result.runs
    (fault,) = only.outcome.seen.faults
    assert fault["t"] is not None and fault["detail"]["exit_code"] == -9, fault
    summary = passed(result)
    assert summary["recoveries"] == [] and set(summary["world_size_by_step"]) == {3}
    assert cluster.operator.running
