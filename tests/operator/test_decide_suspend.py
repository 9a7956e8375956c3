"""The reconcile decision for suspended and resumed TrainJobs, one observed snapshot at a time
(pure: no API server, no etcd); the rest of decide is tested in test_decide.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_builders import (
    T0,
    UID,
    Cluster,
    agents,
    job_object,
    names,
    pod,
    progress,
    run,
    running,
    settle,
)

from keepstep.operator.actions import (
    ClaimPrefix,
    CreatePod,
    Decision,
    DeleteCause,
    DeletePod,
    Event,
)
from keepstep.operator.model import PodPhase

# ---------------------------------------------------------------- suspend and resume


def test_suspend_deletes_every_pod_then_clears_the_records_and_resume_recreates() -> None:
    cluster = Cluster(job_object(nodes=2, min_nodes=1))
    settle(cluster)
    cluster.agents = replace(agents(["demo-node-0", "demo-node-1"]))
    cluster.obj["spec"]["suspend"] = True
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert sorted(names(d.of(DeletePod))) == ["demo-node-0", "demo-node-1"]
    assert d.status["phase"] == "Suspended"
    assert not d.of(CreatePod)
    cluster.apply(d)
    # The agents drained and their leases expired; their epoch record is still there.
    cluster.agents = replace(cluster.agents, nodes={})
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert d.of(ClaimPrefix) == [ClaimPrefix("ns.demo", UID, reset=True)]
    cluster.apply(d)
    assert settle(cluster).actions == ()
    cluster.obj["spec"]["suspend"] = False
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert [c.index for c in d.of(CreatePod)] == [2, 3]
    assert d.status["phase"] == "Pending"
    suspended = {c["type"]: c for c in d.status["conditions"]}["Suspended"]
    assert suspended["status"] == "False"


def agent_args_of(d: Decision) -> dict[str, list[str]]:
    return {c.name: c.manifest["spec"]["containers"][0]["args"] for c in d.of(CreatePod)}


def suspended_after_training(checkpoint: dict[str, Any] | None) -> Cluster:
    """A 2-node job that trained to step 30, was suspended, and whose agents are gone."""
    cluster = Cluster(job_object(nodes=2, min_nodes=1, checkpoint=checkpoint))
    settle(cluster)
    trained = {n: progress(n, 30, world=2) for n in ("demo-node-0", "demo-node-1")}
    cluster.agents = agents(["demo-node-0", "demo-node-1"], progress=trained)
    settle(cluster)
    assert (cluster.obj["status"]["phase"], cluster.obj["status"]["step"]) == ("Running", 30)
    cluster.obj["spec"]["suspend"] = True
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    cluster.agents = replace(cluster.agents, nodes={})
    settle(cluster)  # the records are cleared; status.step stays
    assert cluster.agents.progress == {} and cluster.obj["status"]["step"] == 30
    cluster.obj["spec"]["suspend"] = False
    return cluster


def test_a_resumed_job_with_a_checkpoint_starts_its_pods_from_it() -> None:
    uri = "s3://bucket/demo"
    cluster = suspended_after_training({"uri": uri, "everySteps": 10})
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    args = agent_args_of(d)
    assert sorted(args) == ["demo-node-2", "demo-node-3"]
    for flags in args.values():
        sep = flags.index("--")
        assert flags[sep - 6 : sep] == [
            "--checkpoint", uri, "--checkpoint-every", "10", "--resume", uri,
        ]  # fmt: skip
    (created,) = [e for e in d.of(Event) if e.reason == "CreatedPods"]
    assert f"resuming from the newest checkpoint at {uri}" in created.message
    cluster.apply(d)
    # A pod of the resumed run that fails before the agents agree an epoch: its
    # replacement starts from the checkpoint too, like the rest of the run.
    cluster.pods["demo-node-2"] = pod(2, PodPhase.FAILED)
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert d.status["phase"] == "Pending"
    flags = agent_args_of(d)["demo-node-4"]
    assert flags[flags.index("--resume") + 1] == uri
    cluster.apply(d)
    # Once the resumed run trains, a replacement is a join: its state comes from peers.
    cluster.agents = replace(agents(["demo-node-3", "demo-node-4"]), owner_uid=UID)
    settle(cluster)
    assert cluster.obj["status"]["phase"] == "Running"
    cluster.pods["demo-node-3"] = pod(3, PodPhase.FAILED)
    # The second pod failure in the window: its replacement waits out a 1 s backoff.
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    d = run(cluster.job, cluster.pod_list(), cluster.agents, now=T0 + 1)
    assert "--resume" not in agent_args_of(d)["demo-node-5"]


def test_a_resumed_job_without_a_checkpoint_starts_over() -> None:
    cluster = suspended_after_training(checkpoint=None)
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert len(agent_args_of(d)) == 2
    assert not any("--resume" in flags for flags in agent_args_of(d).values())


def test_a_job_suspended_before_it_trained_does_not_resume() -> None:
    # Created suspended (a queue admits it later): no step was ever committed.
    cluster = Cluster(job_object(nodes=2, suspend=True, checkpoint={"uri": "file:///c"}))
    settle(cluster)
    assert cluster.obj["status"]["phase"] == "Suspended"
    cluster.obj["spec"]["suspend"] = False
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert len(agent_args_of(d)) == 2
    assert not any("--resume" in flags for flags in agent_args_of(d).values())


# ---------------------------------------------------------------- resume after the old run ended

URI = "s3://bucket/demo"
OLD = ["demo-node-0", "demo-node-1"]


def conditions_of(status: Any) -> dict[str, Any]:
    return {c["type"]: c for c in status.get("conditions", [])}


def suspended_mid_run(checkpoint: dict[str, Any] | None) -> Cluster:
    """A 2-node job that trained to step 30 and was suspended, then un-suspended at once:
    its pods are still terminating and its agents' records are still in etcd."""
    cluster = Cluster(job_object(nodes=2, min_nodes=1, checkpoint=checkpoint))
    settle(cluster)
    cluster.pods = {n: running(i) for i, n in enumerate(OLD)}
    cluster.agents = agents(OLD, progress={n: progress(n, 30, world=2) for n in OLD})
    settle(cluster)
    assert (cluster.obj["status"]["phase"], cluster.obj["status"]["step"]) == ("Running", 30)
    cluster.obj["spec"]["suspend"] = True
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert sorted(names(d.of(DeletePod))) == OLD
    cluster.apply(d)
    # The kubelets still stop the draining agents; their leases have not expired yet.
    cluster.pods = {n: replace(running(i), terminating=True) for i, n in enumerate(OLD)}
    assert settle(cluster).actions == ()
    assert cluster.obj["status"]["phase"] == "Suspended"
    cluster.obj["spec"]["suspend"] = False
    return cluster


def test_unsuspended_while_the_old_pods_terminate_waits_pending_and_creates_nothing() -> None:
    cluster = suspended_mid_run({"uri": URI, "everySteps": 10})
    # The old run's epoch and live node records would say Running at once.
    assert cluster.agents.epoch is not None and cluster.agents.nodes
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert not d.of(CreatePod) and not d.of(DeletePod) and not d.of(ClaimPrefix)
    assert d.status["phase"] == "Pending"
    assert "waiting for the suspended run to end: its pods are terminating" in d.reason
    resuming = conditions_of(d.status)["Resuming"]
    assert resuming["status"] == "True" and resuming["reason"] == "SuspendedRunEnding"
    cluster.apply(d)
    # Pending is written now; the wait holds on the next reconciles all the same.
    assert cluster.obj["status"]["phase"] == "Pending"
    assert run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 5).actions == ()
    del cluster.pods["demo-node-0"]
    d = run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 10)
    assert d.actions == () and d.status["phase"] == "Pending"


def test_unsuspended_with_the_pods_gone_clears_the_records_before_creating_pods() -> None:
    cluster = suspended_mid_run({"uri": URI, "everySteps": 10})
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))  # writes Pending
    cluster.pods = {}
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert d.of(ClaimPrefix) == [ClaimPrefix("ns.demo", UID, reset=True)]
    assert not d.of(CreatePod)
    assert d.status["phase"] == "Pending"
    assert "its agent records are being cleared" in conditions_of(d.status)["Resuming"]["message"]
    assert "suspended run: 3 agent records cleared" in d.reason
    cluster.apply(d)
    assert cluster.agents.records == 0 and cluster.agents.epoch is None
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert not d.of(ClaimPrefix)
    args = agent_args_of(d)
    assert sorted(args) == ["demo-node-2", "demo-node-3"]
    assert all(flags[flags.index("--resume") + 1] == URI for flags in args.values())
    assert d.status["phase"] == "Pending"
    resuming = conditions_of(d.status)["Resuming"]
    assert resuming["status"] == "False" and resuming["reason"] == "SuspendedRunEnded"


@pytest.mark.parametrize("checkpoint", [{"uri": URI, "everySteps": 10}, None])
def test_the_resumed_run_starts_only_after_the_suspended_one_ended(
    checkpoint: dict[str, Any] | None,
) -> None:
    cluster = suspended_mid_run(checkpoint)
    steps: list[tuple[str, list[str], bool]] = []  # (phase, created, reset) per reconcile

    def reconcile() -> Decision:
        d = run(cluster.job, cluster.pod_list(), cluster.agents)
        reset = any(c.reset for c in d.of(ClaimPrefix))
        steps.append((d.status["phase"], names(d.of(CreatePod)), reset))
        cluster.apply(d)
        return d

    reconcile()  # pods terminating
    cluster.pods = {}
    reconcile()  # pods gone, records left
    created = reconcile()  # records gone
    assert steps == [
        ("Pending", [], False),
        ("Pending", [], True),
        ("Pending", ["demo-node-2", "demo-node-3"], False),
    ]
    resumes = ["--resume" in flags for flags in agent_args_of(created).values()]
    assert resumes == [checkpoint is not None] * 2
    assert settle(cluster).actions == ()
    # The resumed run's agents agree a fresh epoch: Running, and no wait is left over.
    cluster.agents = agents(["demo-node-2", "demo-node-3"])
    settle(cluster)
    assert cluster.obj["status"]["phase"] == "Running"
    assert conditions_of(cluster.obj["status"])["Resuming"]["status"] == "False"


def test_a_pod_of_the_suspended_run_left_standing_is_deleted_while_waiting() -> None:
    cluster = suspended_mid_run(None)
    cluster.pods["demo-node-1"] = pod(1, PodPhase.FAILED)  # finished, never deleted
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert d.of(DeletePod) == [
        DeletePod("demo-node-1", "the suspended run ends", DeleteCause.SUSPENDED)
    ]
    assert not d.of(CreatePod) and d.status["phase"] == "Pending"


def test_no_pods_are_created_while_etcd_cannot_tell_whether_the_records_are_gone() -> None:
    cluster = suspended_mid_run(None)
    cluster.pods = {}
    d = run(cluster.job, cluster.pod_list(), None)
    assert not d.of(CreatePod) and d.status["phase"] == "Pending"
    assert "etcd unreachable" in conditions_of(d.status)["Resuming"]["message"]


def test_a_lost_status_patch_after_creating_the_resumed_pods_does_not_stall_them() -> None:
    # The pods were created but the status that ended the wait was not written: pods at or
    # above the recorded nextPodIndex are the resumed run's, not the suspended one's.
    cluster = suspended_mid_run({"uri": URI, "everySteps": 10})
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    cluster.pods = {}
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    cluster.apply(Decision(tuple(d.of(CreatePod))))
    assert conditions_of(cluster.obj["status"])["Resuming"]["status"] == "True"
    # Their agents already wrote records: these must not be cleared.
    cluster.agents = agents(["demo-node-2", "demo-node-3"], members=[])
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert not d.of(CreatePod) and not d.of(ClaimPrefix) and not d.of(DeletePod)
    assert conditions_of(d.status)["Resuming"]["status"] == "False"
    assert d.status["nextPodIndex"] == 4


def test_suspended_again_while_waiting_and_resumed_again_still_waits() -> None:
    cluster = suspended_mid_run(None)
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    cluster.obj["spec"]["suspend"] = True
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert d.status["phase"] == "Suspended"
    assert conditions_of(d.status)["Resuming"]["status"] == "False"
    cluster.apply(d)
    cluster.obj["spec"]["suspend"] = False
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert not d.of(CreatePod) and d.status["phase"] == "Pending"
    assert conditions_of(d.status)["Resuming"]["status"] == "True"
