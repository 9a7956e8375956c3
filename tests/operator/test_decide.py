"""The reconcile decision, one observed snapshot at a time (pure: no API server, no etcd)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from op_builders import (
    SHA,
    T0,
    UID,
    Cluster,
    agents,
    done,
    job,
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
    DeleteCause,
    DeletePod,
    EnsureService,
    Event,
    EventType,
    PatchStatus,
)
from keepstep.operator.decide import decide_invalid
from keepstep.operator.model import AgentView, Job, PodPhase, Recovery, format_time

# ---------------------------------------------------------------- creation


def test_fresh_job_creates_one_pod_per_node_the_service_and_claims_the_prefix() -> None:
    d = run(job(nodes=3), [], AgentView(), service_exists=False)
    assert names(d.of(CreatePod)) == ["demo-node-0", "demo-node-1", "demo-node-2"]
    assert [a.index for a in d.of(CreatePod)] == [0, 1, 2]
    assert len(d.of(EnsureService)) == 1
    assert d.of(ClaimPrefix) == [ClaimPrefix("ns.demo", UID, reset=False)]
    (patch,) = d.of(PatchStatus)
    assert patch.patch["phase"] == "Pending"
    assert patch.patch["nextPodIndex"] == 3
    assert patch.patch["selector"] == "keepstep.dev/job=demo"
    assert patch.patch["observedGeneration"] == 1
    assert "created 3 pods" in d.reason
    # Order: etcd prefix, service, pods, events, then the status.
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("ClaimPrefix") < kinds.index("EnsureService") < kinds.index("CreatePod")
    assert kinds.index("CreatePod") < kinds.index("Event") < kinds.index("PatchStatus")
    assert kinds[-1] == "PatchStatus"


def test_a_reconcile_that_changes_nothing_has_no_actions_at_all() -> None:
    cluster = Cluster(job_object(nodes=3))
    first = run(cluster.job, [], cluster.agents, service_exists=False)
    cluster.apply(first)
    again = run(cluster.job, cluster.pod_list(), cluster.agents, service_exists=True)
    assert again.actions == ()
    assert not again.of(PatchStatus)
    assert again.reason.startswith("nothing to do")


def test_a_running_job_with_progress_settles_to_no_writes() -> None:
    cluster = Cluster(job_object(nodes=3))
    settle(cluster)
    nodes = [f"demo-node-{i}" for i in range(3)]
    cluster.pods = {n: running(i) for i, n in enumerate(nodes)}
    cluster.agents = replace(
        agents(nodes), progress={n: progress(n, 40, samples_per_s=123.456) for n in nodes}
    )
    d = run(cluster.job, cluster.pod_list(), cluster.agents, service_exists=True)
    assert d.of(PatchStatus) and d.status["phase"] == "Running"
    cluster.apply(d)
    assert settle(cluster, T0 + 1).actions == ()


def test_created_pods_that_are_not_yet_listed_are_not_created_twice_under_new_names() -> None:
    # A stale pod list with the nextPodIndex already written would give new names; the
    # names come from the status, so a repeat of the same stale snapshot asks for the same
    # names (AlreadyExists), never for pods 3..5.
    d1 = run(job(nodes=3), [], AgentView())
    d2 = run(job(nodes=3), [], AgentView())
    assert names(d1.of(CreatePod)) == names(d2.of(CreatePod))


# ---------------------------------------------------------------- lost pods


def test_a_failed_pod_is_deleted_and_replaced_with_the_next_index() -> None:
    j = job(nodes=3, status={"phase": "Running", "nextPodIndex": 3})
    pods = [running(0), pod(1, PodPhase.FAILED), running(2)]
    ag = agents(["demo-node-0", "demo-node-2"], members=["demo-node-0/0", "demo-node-2/0"])
    d = run(j, pods, ag)
    assert d.of(DeletePod) == [
        DeletePod("demo-node-1", "pod Failed", DeleteCause.LOST, grace_seconds=0)
    ]
    assert [(c.index, c.name) for c in d.of(CreatePod)] == [(3, "demo-node-3")]
    assert d.status["nextPodIndex"] == 4
    assert any(e.reason == "PodLost" and e.type is EventType.WARNING for e in d.of(Event))


def test_a_deleted_pod_is_replaced_with_a_new_index_never_a_reused_one() -> None:
    j = job(nodes=3, status={"phase": "Pending", "nextPodIndex": 3})
    d = run(j, [pod(0), pod(2)], AgentView(owner_uid=UID))
    assert [c.index for c in d.of(CreatePod)] == [3]
    assert not d.of(DeletePod)


def test_the_next_index_covers_pods_the_status_does_not_know_of() -> None:
    # A status patch lost after its pods were created: indices continue after the pods.
    j = job(nodes=3, status={"nextPodIndex": 0})
    d = run(j, [pod(5), pod(6)], AgentView(owner_uid=UID))
    assert [c.index for c in d.of(CreatePod)] == [7]
    assert d.status["nextPodIndex"] == 8


def test_a_pod_whose_agent_vanished_is_lost_only_after_the_grace() -> None:
    j = job(nodes=3, status={"phase": "Running", "nextPodIndex": 3})
    pods = [running(0), running(1), running(2)]
    # node-1 was seen at T0 + 5, then its leased record expired (a killed node).
    ag = replace(agents(["demo-node-0", "demo-node-2"]), last_seen={"demo-node-1": T0 + 5})
    assert not run(j, pods, ag, T0 + 5 + 14).of(DeletePod)
    d = run(j, pods, ag, T0 + 5 + 16)
    (delete,) = d.of(DeletePod)
    assert delete.name == "demo-node-1" and delete.grace_seconds == 0
    assert "missing from etcd" in delete.why
    assert [c.index for c in d.of(CreatePod)] == [3]


def test_a_running_pod_whose_agent_never_registered_counts_from_its_start() -> None:
    # An agent never seen is still starting (imports, model): it gets the start grace
    # (120 s), not the lost-pod grace (15 s) of an agent that was seen and vanished.
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 3})
    pods = [running(0), running(2, since=T0 + 100)]
    ag = agents(["demo-node-0"])
    assert not run(j, pods, ag, T0 + 116).of(DeletePod)
    assert not run(j, pods, ag, T0 + 219).of(DeletePod)
    assert names(run(j, pods, ag, T0 + 221).of(DeletePod)) == ["demo-node-2"]


def test_a_replacement_is_kept_off_the_node_its_predecessor_was_lost_on() -> None:
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 2})
    lost = replace(running(1), node="dead-node")
    d = run(j, [replace(running(0), node="n0"), lost], agents(["demo-node-0"]), T0 + 1000)
    assert names(d.of(DeletePod)) == ["demo-node-1"]
    (created,) = d.of(CreatePod)
    affinity = created.manifest["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["dead-node"]}]}
    ]


def test_missing_agent_records_do_not_condemn_pods_before_the_job_runs() -> None:
    j = job(nodes=2, min_nodes=1, status={"phase": "Pending", "nextPodIndex": 2})
    d = run(j, [running(0), running(1)], AgentView(owner_uid=UID), T0 + 1000)
    assert not d.of(DeletePod) and not d.of(CreatePod)


def test_a_pod_that_exited_without_finishing_is_replaced_and_one_that_finished_is_not() -> None:
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 2})
    pods = [pod(0, PodPhase.SUCCEEDED), pod(1, PodPhase.SUCCEEDED)]
    ag = replace(
        agents(["demo-node-1"], members=["demo-node-0/0", "demo-node-1/0"]),
        done=done(["demo-node-0/0"]),
    )
    d = run(j, pods, ag)
    assert names(d.of(DeletePod)) == ["demo-node-1"]
    assert [c.index for c in d.of(CreatePod)] == [2]


def test_terminating_pods_are_neither_live_nor_deleted_again() -> None:
    j = job(nodes=2, min_nodes=1, status={"phase": "Pending", "nextPodIndex": 2})
    d = run(j, [pod(0), pod(1, terminating=True)], AgentView(owner_uid=UID))
    assert not d.of(DeletePod)
    assert [c.index for c in d.of(CreatePod)] == [2]


def test_pods_are_replaced_even_when_etcd_cannot_be_read() -> None:
    status = {"phase": "Running", "nextPodIndex": 3, "step": 17, "nodes": 3, "worldSize": 3}
    j = job(nodes=3, status=status)
    d = run(j, [running(0), pod(1, PodPhase.FAILED), running(2)], None)
    assert names(d.of(DeletePod)) == ["demo-node-1"]
    assert [c.index for c in d.of(CreatePod)] == [3]
    assert not d.of(ClaimPrefix)
    assert d.status["step"] == 17 and d.status["phase"] == "Running"


# ---------------------------------------------------------------- scaling


def test_scale_up_three_to_four_adds_one_pod() -> None:
    cluster = Cluster(job_object(nodes=3))
    settle(cluster)
    cluster.obj["spec"]["trainer"]["numNodes"] = 4
    cluster.obj["metadata"]["generation"] = 2
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert [c.index for c in d.of(CreatePod)] == [3]
    assert not d.of(DeletePod)
    assert d.status["observedGeneration"] == 2


def test_scale_down_four_to_three_deletes_the_highest_index_gracefully() -> None:
    j = job(nodes=3, status={"phase": "Running", "nextPodIndex": 6})
    pods = [running(0), running(2), running(5), running(4)]
    ag = agents([p.name for p in pods])
    d = run(j, pods, ag)
    assert d.of(DeletePod) == [
        DeletePod("demo-node-5", "scale down to 3", DeleteCause.SCALE_DOWN, grace_seconds=None)
    ]
    assert not d.of(CreatePod)
    assert "scaled down 4 -> 3" in d.reason


def test_never_more_pods_than_max_nodes() -> None:
    j = job(nodes=9, max_nodes=4)  # the CRD refuses this; the operator caps it anyway
    assert len(run(j, [], AgentView()).of(CreatePod)) == 4
    assert "--nodes" in (
        args := run(j, [], AgentView()).of(CreatePod)[0].manifest["spec"]["containers"][0]["args"]
    )
    assert args[args.index("--nodes") + 1] == "4"


# ---------------------------------------------------------------- min nodes, completion


def test_below_min_nodes_for_longer_than_the_grace_fails_the_job() -> None:
    cluster = Cluster(job_object(nodes=3, min_nodes=2), agents(["demo-node-0"]))
    cluster.obj["status"] = {"phase": "Running", "nextPodIndex": 3}
    cluster.pods = {f"demo-node-{i}": pod(i) for i in range(3)}
    cluster.service = True
    d = run(cluster.job, cluster.pod_list(), cluster.agents, T0)
    assert d.status["phase"] == "Running"
    assert d.status["belowMinNodesSince"] == format_time(T0)
    assert any(e.reason == "BelowMinNodes" for e in d.of(Event))
    cluster.apply(d)
    assert run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 59).actions == ()
    d = run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 61)
    assert d.status["phase"] == "Failed"
    assert "minNodes 2" in d.reason
    assert sorted(names(d.of(DeletePod))) == [f"demo-node-{i}" for i in range(3)]
    failed = {c["type"]: c for c in d.status["conditions"]}["Failed"]
    assert failed["status"] == "True" and "1 live agents < minNodes 2" in failed["message"]
    cluster.apply(d)
    # Failed is final: nothing is recreated or rewritten, and the conditions keep saying why.
    assert run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 200).actions == ()
    assert cluster.obj["status"]["conditions"] == d.status["conditions"]


def test_enough_agents_again_clears_the_below_min_clock() -> None:
    status = {"phase": "Running", "nextPodIndex": 3, "belowMinNodesSince": format_time(T0)}
    j = job(nodes=3, min_nodes=2, status=status)
    ag = agents(["demo-node-0", "demo-node-1"])
    d = run(j, [running(0), running(1), pod(2)], ag, T0 + 30)
    assert d.status["phase"] == "Running" and "belowMinNodesSince" not in d.status
    assert d.of(PatchStatus)[0].patch["belowMinNodesSince"] is None


def test_every_worker_done_marks_the_job_succeeded_with_its_parameters() -> None:
    members = ["demo-node-0/0", "demo-node-1/0"]
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 2})
    ag = replace(agents([], members=members), done=done(members))
    pods = [pod(0, PodPhase.SUCCEEDED), pod(1, PodPhase.SUCCEEDED)]
    d = run(j, pods, ag)
    assert d.status["phase"] == "Succeeded"
    assert d.status["paramsSha256"] == SHA
    true = {c["type"] for c in d.status["conditions"] if c["status"] == "True"}
    assert true == {"Succeeded", "Complete"}  # Complete: what `kubectl wait` users expect
    assert not d.of(CreatePod) and not d.of(DeletePod)
    assert any(e.reason == "Succeeded" for e in d.of(Event))


def test_done_records_of_part_of_the_epoch_are_not_completion() -> None:
    members = ["demo-node-0/0", "demo-node-1/0"]
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 2})
    ag = replace(agents(["demo-node-1"], members=members), done=done(members[:1]))
    assert run(j, [pod(0, PodPhase.SUCCEEDED), running(1)], ag).status["phase"] == "Running"


def test_workers_that_disagree_on_the_parameters_fail_the_job() -> None:
    members = ["demo-node-0/0", "demo-node-1/0"]
    j = job(nodes=2, min_nodes=1, status={"phase": "Running", "nextPodIndex": 2})
    ag = replace(
        agents([], members=members), done={**done(members[:1]), **done(members[1:], "cd" * 32)}
    )
    d = run(j, [], ag)
    assert d.status["phase"] == "Failed" and "2 different parameters" in d.reason


# ---------------------------------------------------------------- status figures


def test_status_figures_come_from_the_agent_records() -> None:
    nodes = ["demo-node-0", "demo-node-1", "demo-node-2"]
    ag = replace(
        agents(nodes, epoch=3),
        progress={
            "demo-node-0": progress("demo-node-0", 41, epoch=3, samples_per_s=250.04),
            "demo-node-1": progress("demo-node-1", 40, epoch=3, samples_per_s=249.0),
            "demo-node-2": progress("demo-node-2", 12, epoch=2),
        },
        recoveries=(
            Recovery(2, "demo-node-0/0", 0.5),
            Recovery(2, "demo-node-1/0", 0.7),
            Recovery(3, "demo-node-0/0", 0.2),
            Recovery(4, "demo-node-0/0", 0.9),
        ),
    )
    d = run(
        job(nodes=3, status={"phase": "Running", "nextPodIndex": 3}),
        [running(i) for i in range(3)],
        ag,
    )
    s = d.status
    assert (s["nodes"], s["worldSize"], s["epoch"]) == (3, 3, 3)
    assert s["step"] == 41 and s["lastSnapshotStep"] == 40
    assert s["samplesPerSecond"] == 250.0
    assert s["recoveries"] == 3
    assert s["mttrP50Seconds"] == 0.7 and s["lastMttrSeconds"] == 0.9
    assert "snapshotBytes" not in s  # no agent reported its snapshot files yet


def test_the_largest_reported_snapshot_sizes_the_next_pods_dev_shm() -> None:
    nodes = ["demo-node-0", "demo-node-1"]
    sizes = {"demo-node-0": 300 << 20, "demo-node-1": 500 << 20}
    ag = replace(
        agents(nodes, epoch=1),
        progress={n: progress(n, 5, snapshot_bytes=b) for n, b in sizes.items()},
    )
    d = run(job(nodes=3, status={"phase": "Running", "nextPodIndex": 2}), [running(0)], ag)
    assert d.status["snapshotBytes"] == 500 << 20
    # Sticky: a smaller report (a node that has not committed since a resume) keeps it.
    ag = replace(ag, progress={"demo-node-0": progress("demo-node-0", 6, snapshot_bytes=1)})
    status = {"phase": "Running", "nextPodIndex": 2, "snapshotBytes": 500 << 20}
    assert run(job(nodes=2, status=status), [running(0)], ag).status["snapshotBytes"] == 500 << 20


def test_conditions_keep_their_transition_time_while_their_status_holds() -> None:
    nodes = ["demo-node-0", "demo-node-1"]
    cluster = Cluster(job_object(nodes=2, min_nodes=1), agents(nodes))
    cluster.pods = {n: running(i) for i, n in enumerate(nodes)}
    cluster.service = True
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents, T0))
    first = {c["type"]: c for c in cluster.obj["status"]["conditions"]}["Running"]
    assert first["status"] == "True" and first["lastTransitionTime"] == format_time(T0)
    settle(cluster, T0 + 100)
    later = {c["type"]: c for c in cluster.obj["status"]["conditions"]}["Running"]
    assert later["lastTransitionTime"] == format_time(T0)


# ---------------------------------------------------------------- the etcd prefix, odd cases


def test_records_of_an_earlier_job_with_the_same_name_are_reset() -> None:
    d = run(job(), [], AgentView(owner_uid="uid-0", records=5))
    assert d.of(ClaimPrefix) == [ClaimPrefix("ns.demo", UID, reset=True)]


def test_a_job_being_deleted_is_left_to_the_finalizer() -> None:
    obj = job_object()
    obj["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    d = run(Job.from_object(obj), [], AgentView())
    assert d.actions == () and "deleted" in d.reason


def test_an_invalid_spec_fails_the_job_once() -> None:
    d = decide_invalid(job_object(status={"phase": "Pending"}), "bad batch", T0)
    assert d.status["phase"] == "Failed"
    assert any(isinstance(a, Event) and a.message == "bad batch" for a in d.actions)
    again = decide_invalid(job_object(status=dict(d.status)), "bad batch", T0)
    assert again.actions == ()


# ---------------------------------------------------------------- scale


@pytest.mark.parametrize("n", [1000])
def test_a_thousand_node_job_is_decided_in_one_reconcile(n: int) -> None:
    """All pods in one decision, and nothing to do once they run (the time it takes is
    bench/operator_scale.py's figure, not an assertion here)."""
    cluster = Cluster(job_object(nodes=n, max_nodes=n))
    cluster.obj["spec"]["elasticPolicy"]["globalBatchSize"] = n
    cluster.obj["spec"]["elasticPolicy"]["microBatchSize"] = 1
    d = run(cluster.job, [], AgentView(), service_exists=False)
    assert len(d.of(CreatePod)) == n
    cluster.apply(d)
    nodes = [f"demo-node-{i}" for i in range(n)]
    cluster.pods = {name: running(i) for i, name in enumerate(nodes)}
    cluster.agents = replace(agents(nodes), progress={m: progress(m, 5, world=n) for m in nodes})
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    noop = run(cluster.job, cluster.pod_list(), cluster.agents, service_exists=True)
    assert noop.actions == ()
