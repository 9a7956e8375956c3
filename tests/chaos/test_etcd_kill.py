"""kill-etcd against a run with three etcd members: which member the injector takes, how
it reads the members from their processes, and how the scenario asks for three."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from keepstep.chaos.actions import EtcdMember, etcd_member, etcd_victim
from keepstep.chaos.local import LocalTarget
from keepstep.chaos.model import Job
from keepstep.chaos.runner import job_key
from keepstep.chaos.scenario import load_scenario
from keepstep.cli import build_parser
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_cluster import EtcdCluster
from keepstep.launch.run import RunConfig

SCENARIOS = Path(__file__).resolve().parents[2] / "e2e" / "scenarios"


def member(i: int, leader: bool | None) -> EtcdMember:
    return EtcdMember(100 + i, f"keepstep-{i}", f"127.0.0.1:{2000 + i}", leader)


def test_the_leader_is_killed_of_three() -> None:
    chosen, why = etcd_victim([member(0, False), member(1, True), member(2, False)])
    assert chosen.name == "keepstep-1" and why == "the leader of 3 live members"


def test_mid_election_the_first_by_name_is_killed() -> None:
    chosen, why = etcd_victim([member(2, None), member(0, False), member(1, None)])
    assert chosen.name == "keepstep-0" and "none said it leads" in why


def test_the_only_etcd_is_killed_whatever_it_says() -> None:
    chosen, why = etcd_victim([member(0, None)])
    assert chosen.pid == 100 and why == "the run's only etcd"
    with pytest.raises(ValueError, match="no live etcd member"):
        etcd_victim([])


def test_members_are_read_from_their_processes(etcd_binary: str, tmp_path: Path) -> None:
    with EtcdCluster.start(etcd_binary, tmp_path) as cluster:
        seen = [etcd_member(pid) for pid in cluster.pids]
        assert [m.name for m in seen] == ["keepstep-0", "keepstep-1", "keepstep-2"]
        assert [m.endpoint for m in seen] == cluster.endpoint.split(",")
        assert [m.leader for m in seen].count(True) == 1
        leader = cluster.leader()
        assert leader is not None and seen[leader].leader
        assert etcd_victim(seen)[0] == seen[leader]


def test_kill_etcd_runs_its_job_with_three_members(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "kill-etcd.yaml")
    assert scenario.job.etcd_members == 3 and scenario.known_failure is None
    argv = LocalTarget().command(scenario.job, None, tmp_path)
    assert argv[argv.index("--etcd-members") + 1] == "3"
    restart = load_scenario(SCENARIOS / "etcd-restart.yaml")
    assert restart.job.etcd_members == 1
    assert "--etcd-members" not in LocalTarget().command(restart.job, None, tmp_path)
    # The members change no number: both share one fault-free reference run.
    assert job_key(scenario.job) == job_key(replace(scenario.job, etcd_members=1))


def test_only_one_or_three_members(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="etcd_members 2; allowed: 1, 3"):
        Job("examples/mlp.py", 3, 48, 4, 10, etcd_members=2)
    script = str(SCENARIOS.parents[1] / "examples" / "mlp.py")
    with pytest.raises(ConfigError, match="--etcd-members 2; allowed: 1, 3"):
        RunConfig(script, (), 2, 8, 4, 2, tmp_path, "etcd", etcd_members=2)
    run = ["run", "--nodes", "2", "--global-batch", "8", "--micro-batch", "4", "--steps", "2"]
    assert build_parser().parse_args([*run, "train.py"]).etcd_members == 1
    assert build_parser().parse_args([*run, "--etcd-members", "3", "train.py"]).etcd_members == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args([*run, "--etcd-members", "2", "train.py"])
