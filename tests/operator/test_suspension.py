"""The hand-over from a suspended run to its resumed run (pure: job, pods, agents)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from op_builders import UID, agents, job, pod

from keepstep.operator.actions import ClaimPrefix
from keepstep.operator.model import AgentView
from keepstep.operator.suspension import (
    SuspendedRun,
    prefix_claim,
    resuming,
    suspended_run,
    waiting,
)

WAITING_STATUS = {
    "phase": "Pending",
    "nextPodIndex": 2,
    "conditions": [{"type": "Resuming", "status": "True"}],
}


def test_counts_below_zero_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="records=-1"):
        SuspendedRun(0, -1)


def test_a_job_that_was_never_suspended_has_no_suspended_run() -> None:
    assert (
        suspended_run(job(status={"phase": "Running"}), [pod(0)], agents(["demo-node-0"])) is None
    )
    assert suspended_run(job(), [], AgentView()) is None


def test_a_final_job_has_no_suspended_run_even_with_the_condition_left() -> None:
    status = {**WAITING_STATUS, "phase": "Succeeded"}
    assert suspended_run(job(status=status), [pod(0)], AgentView()) is None


def test_every_listed_pod_below_the_recorded_index_counts_owned_or_not() -> None:
    # An earlier job's pod with this name writes the same etcd prefix: it must go too.
    pods = [replace(pod(0), terminating=True), replace(pod(1), owned=False)]
    left = suspended_run(job(status=WAITING_STATUS), pods, AgentView(owner_uid=UID, records=2))
    assert left == SuspendedRun(2, 2)
    assert not left.ended and not left.clear_records
    assert "its pods are terminating" in left.why


def test_an_owned_pod_at_the_recorded_index_means_the_resumed_run_started() -> None:
    j = job(status=WAITING_STATUS)
    assert suspended_run(j, [pod(0), pod(2)], AgentView(owner_uid=UID)) is None
    # Not while suspended again: then every pod is the suspended run's.
    suspended = job(suspend=True, status=WAITING_STATUS)
    assert suspended_run(suspended, [pod(2)], AgentView(owner_uid=UID)) == SuspendedRun(1, 0)


def test_waiting_ends_when_no_pod_and_no_record_is_left() -> None:
    j = job(status=WAITING_STATUS)
    assert resuming(j.status)
    assert waiting(j, SuspendedRun(0, 3)) and waiting(j, SuspendedRun(0, None))
    assert not waiting(j, SuspendedRun(0, 0))
    assert not waiting(job(suspend=True, status=WAITING_STATUS), SuspendedRun(1, 3))


def test_the_records_are_reset_once_the_pods_are_gone_and_only_then() -> None:
    j = job(status=WAITING_STATUS)
    ag = AgentView(owner_uid=UID, records=3)
    assert prefix_claim(j, ag, SuspendedRun(1, 3)) is None
    claim = prefix_claim(j, ag, SuspendedRun(0, 3))
    assert claim is not None and claim[0] == ClaimPrefix("ns.demo", UID, reset=True)
    assert prefix_claim(j, AgentView(owner_uid=UID), SuspendedRun(0, 0)) is None
    assert prefix_claim(j, None, SuspendedRun(0, None)) is None
