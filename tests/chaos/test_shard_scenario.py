"""A sharded job in the chaos harness: `shard` in a scenario's job reaches `keepstep run`,
and its fault-free reference is the same job with full replicas (one cached reference for
both), so a sharded run must end with the numbers of full replicas."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from keepstep.chaos.local import LocalTarget
from keepstep.chaos.model import Job
from keepstep.chaos.runner import job_key, reference
from keepstep.chaos.scenario import load_scenario
from keepstep.chaos.target import RunOutcome
from keepstep.errors import ConfigError

SCENARIOS = Path(__file__).resolve().parents[2] / "e2e" / "scenarios"
SCENARIO = SCENARIOS / "shard-zero1.yaml"


@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_the_sharded_scenario_runs_keepstep_run_with_shard(tmp_path: Path, shard: str) -> None:
    scenario = load_scenario(SCENARIOS / f"shard-{shard}.yaml")
    assert scenario.job.shard == shard and scenario.job.nodes == 4
    argv = LocalTarget().command(scenario.job, None, tmp_path)
    assert argv[argv.index("--shard") + 1] == shard
    plain = LocalTarget().command(replace(scenario.job, shard=None), None, tmp_path)
    assert "--shard" not in plain
    with pytest.raises(ConfigError, match="shard 'zero3'; allowed: zero1, zero2"):
        Job("examples/mlp.py", 3, 48, 4, 10, shard="zero3")


def test_the_reference_of_a_sharded_job_has_full_replicas(tmp_path: Path) -> None:
    job = load_scenario(SCENARIO).job
    assert job_key(job) == job_key(replace(job, shard=None))
    ran: list[Job] = []

    class Recording(LocalTarget):
        def run(self, job: Job, plan: object, run_dir: Path) -> RunOutcome:
            ran.append(job)
            raise RuntimeError("recorded")  # the reference would run here

    with pytest.raises(RuntimeError, match="recorded"):
        reference(job, Recording(), tmp_path, say=lambda _: None)
    assert [j.shard for j in ran] == [None]
