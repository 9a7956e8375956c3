"""No silent loops: refused pod creations, pods stuck Pending and crash-looping agents each
give a condition that names the cause, back off exponentially, and fail the job once its
failure budget is spent.

Pod creations are refused by the in-memory API server (`fake_kube.FakeKube`) through a
real `Reconciler` with an injected clock; pods that cannot start or that crash are fed to
the pure decision, one snapshot and one `now` at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
from fake_kube import QUOTA, FakeKube
from op_builders import CONFIG, ETCD, T0, Cluster, agents, job_object, pod, run, running, settle

from keepstep.agent.kv.memory import MemoryKV
from keepstep.operator.actions import CreatePod, DeletePod, Event, EventType
from keepstep.operator.agents import AgentStore
from keepstep.operator.failures import Ledger, Policy
from keepstep.operator.handlers import next_wait, retry_delay
from keepstep.operator.model import PodPhase, PodView, format_time, pod_summary
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import DecideConfig
from keepstep.operator.spec import FailurePolicy


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def refusing(**job: Any) -> tuple[FakeKube, Reconciler, Clock]:
    kube, clock = FakeKube(), Clock()
    kube.jobs["demo"] = job_object(**job)
    kube.refuse = QUOTA
    store = AgentStore(MemoryKV(), 0.5)
    return kube, Reconciler(kube, store, DecideConfig(ETCD), clock=clock), clock


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found


# ---------------------------------------------------------------- refused creations


def test_a_refused_creation_sets_the_condition_and_backs_off_with_no_success_event() -> None:
    kube, reconciler, clock = refusing(nodes=3)
    outcome = reconciler.reconcile("ns", "demo")
    status = kube.jobs["demo"]["status"]
    assert kube.create_attempts == 3 and not kube.pods
    refused = condition(status, "PodCreateRefused")
    assert (refused["status"], refused["reason"]) == ("True", "Forbidden")
    assert "exceeded quota: zero" in refused["message"]
    assert status["createBackoffUntil"] == format_time(T0 + 1)
    assert status["nextPodIndex"] == 0  # the refused names were never used
    (failure,) = status["podFailures"]
    assert (failure["cause"], failure["reason"]) == ("PodCreateRefused", "Forbidden")
    reasons = [e.reason for e in kube.events]
    assert "CreatedPods" not in reasons
    (warning,) = [e for e in kube.events if e.reason == "PodCreateRefused"]
    assert warning.type is EventType.WARNING and "exceeded quota" in warning.message
    assert "3 of 3 pods refused" in warning.message and "next attempt in 1 s" in warning.message
    assert outcome.retry_at == T0 + 1 and "refused (Forbidden)" in outcome.decision.reason
    # Within the backoff a reconcile reads, and neither creates nor writes anything.
    clock.now = T0 + 0.5
    quiet = reconciler.reconcile("ns", "demo")
    assert quiet.decision.actions == () and kube.create_attempts == 3
    assert "backing off" in quiet.decision.reason


def test_refused_attempts_back_off_exponentially_then_the_job_fails() -> None:
    kube, reconciler, clock = refusing(nodes=1, min_nodes=1)
    attempts: list[float] = []
    while clock.now < T0 + 120 and kube.jobs["demo"]["status"].get("phase") != "Failed":
        before = kube.create_attempts
        reconciler.reconcile("ns", "demo")  # every 0.25 s: as often as events could wake it
        if kube.create_attempts > before:
            attempts.append(clock.now - T0)
        clock.now += 0.25
    # A retry every second would be 480 attempts; the backoff doubles: 1, 2, 4, 8, ... s.
    assert attempts == [0, 1, 3, 7, 15, 31, 63], attempts
    status = kube.jobs["demo"]["status"]
    assert status["phase"] == "Failed"
    failed = condition(status, "Failed")
    assert failed["reason"] == "PodCreateRefused"
    assert "7 failures in 600 s, more than failurePolicy.backoffLimit 6" in failed["message"]
    assert [e.reason for e in kube.events].count("PodCreateRefused") == 7  # one per attempt


def test_the_condition_clears_once_pods_are_created() -> None:
    kube, reconciler, clock = refusing(nodes=2, min_nodes=1)
    reconciler.reconcile("ns", "demo")
    kube.refuse = None  # the quota was raised
    clock.now = T0 + 1
    reconciler.reconcile("ns", "demo")
    status = kube.jobs["demo"]["status"]
    assert sorted(kube.pods) == ["demo-node-0", "demo-node-1"]
    refused = condition(status, "PodCreateRefused")
    assert (refused["status"], refused["reason"]) == ("False", "PodsCreated")
    assert "createBackoffUntil" not in status
    assert len(status["podFailures"]) == 1  # the record stays for the window
    assert "CreatedPods" in [e.reason for e in kube.events]


def test_a_job_budget_in_the_spec_wins_over_the_operators() -> None:
    kube, reconciler, _ = refusing(nodes=1, min_nodes=1)
    kube.jobs["demo"]["spec"]["failurePolicy"] = {"backoffLimit": 0}
    reconciler.reconcile("ns", "demo")
    status = kube.jobs["demo"]["status"]
    assert status["phase"] == "Failed"
    assert condition(status, "Failed")["reason"] == "PodCreateRefused"


# ---------------------------------------------------------------- stuck Pending


STUCK = [
    ("CreateContainerConfigError", 'secret "keepstep-s3" not found'),
    ("ImagePullBackOff", 'Back-off pulling image "keepstep/agent:typo"'),
    ("ErrImagePull", "rpc error: manifest unknown"),
]


@pytest.mark.parametrize(("reason", "message"), STUCK, ids=[s[0] for s in STUCK])
def test_a_pod_stuck_pending_is_replaced_counted_and_fails_the_job(
    reason: str, message: str
) -> None:
    obj = job_object(nodes=2, min_nodes=1)
    obj["spec"]["failurePolicy"] = {"pendingTimeoutSeconds": 60}
    cluster = Cluster(obj)
    settle(cluster)
    now = T0

    def stuck_since(at: float) -> None:
        cluster.pods = {
            n: PodView(n, p.index, PodPhase.PENDING, created_at=at, waiting=reason,
                       waiting_message=message)
            for n, p in cluster.pods.items()
        }  # fmt: skip

    stuck_since(now)
    # Within the grace nothing happens; after it, both pods are lost and counted.
    assert not run(cluster.job, cluster.pod_list(), cluster.agents, now + 59).of(DeletePod)
    now += 61
    d = run(cluster.job, cluster.pod_list(), cluster.agents, now)
    assert [a.name for a in d.of(DeletePod)] == ["demo-node-0", "demo-node-1"]
    lost = [e for e in d.of(Event) if e.reason == "PodLost"]
    assert f"Pending for 61 s ({reason})" in lost[0].message
    assert f"[PodsUnschedulable: {reason}]" in lost[0].message
    assert not d.of(CreatePod)  # two failures: the replacements wait 1 s
    reported = condition(dict(d.status), "PodsUnschedulable")
    assert (reported["status"], reported["reason"]) == ("True", reason)
    assert message in reported["message"]
    assert f"no pod is created before {format_time(now + 1)}" in reported["message"]
    assert d.status["createBackoffUntil"] == format_time(now + 1)
    cluster.apply(d)
    d = run(cluster.job, cluster.pod_list(), cluster.agents, now + 1)
    assert [c.index for c in d.of(CreatePod)] == [2, 3]
    cluster.apply(d)
    # The replacements cannot start either: with backoffLimit 6, the 7th failure ends it.
    rounds = 1
    while cluster.obj["status"]["phase"] != "Failed" and rounds < 10:
        stuck_since(now + 30)
        now += 91
        cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents, now))
        cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents, now + 30))
        rounds += 1
    assert rounds == 4  # 2, 4, 6, then 8 failures
    status = cluster.obj["status"]
    failed = condition(status, "Failed")
    assert failed["reason"] == "PodsUnschedulable" and reason in failed["message"]
    assert len(status["podFailures"]) == 8


def test_a_pod_waiting_for_a_node_is_left_while_the_job_trains_without_it() -> None:
    cluster = Cluster(job_object(nodes=3, min_nodes=2))
    settle(cluster)
    nodes = ["demo-node-0", "demo-node-1"]
    waiting = {"waiting": "Unschedulable", "waiting_message": "0/5 nodes are available"}
    cluster.pods = {n: running(i) for i, n in enumerate(nodes)}
    cluster.pods["demo-node-2"] = pod(2, created_at=T0, **waiting)
    cluster.agents = agents(nodes)
    d = run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 1000)
    assert not d.of(DeletePod) and not d.of(CreatePod)
    assert d.status["phase"] == "Running" and "podFailures" not in d.status
    reported = condition(dict(d.status), "PodsUnschedulable")
    assert (reported["status"], reported["reason"]) == ("True", "Unschedulable")
    assert "1 pods wait for a node (demo-node-2): 0/5 nodes are available" == reported["message"]


# ---------------------------------------------------------------- crash loops


def crash(cluster: Cluster, index: int, ended: str = "Error, exit code 1") -> None:
    name = f"demo-node-{index}"
    cluster.pods[name] = PodView(name, index, PodPhase.FAILED, ended=ended)


def test_a_crash_looping_agent_is_replaced_with_growing_delays_then_the_job_fails() -> None:
    cluster = Cluster(job_object(nodes=1, min_nodes=1))
    now = T0
    settle(cluster, now)
    created: list[float] = []
    while cluster.obj["status"].get("phase") != "Failed" and now < T0 + 600:
        for p in list(cluster.pods.values()):
            if p.phase is PodPhase.PENDING:
                crash(cluster, p.index)  # every agent dies as soon as it starts
        d = run(cluster.job, cluster.pod_list(), cluster.agents, now)
        if d.of(CreatePod):
            created.append(now - T0)
        cluster.apply(d)
        now += 0.5
    # The first crash is replaced at once, then 1, 2, 4, 8, 16 s later (the status keeps
    # whole seconds, rounded up).
    assert created == [0, 2, 5, 10, 19, 36], created
    status = cluster.obj["status"]
    failed = condition(status, "Failed")
    assert failed["reason"] == "CrashLoop"
    assert "Error, exit code 1" in failed["message"]
    loop = condition(status, "CrashLoop")
    assert loop["status"] == "True" and loop["reason"] == "Error, exit code 1"
    # The job is over: no pod is created any more; the last crashed one is kept to look at.
    assert [p.phase for p in cluster.pods.values()] == [PodPhase.FAILED]
    assert run(cluster.job, cluster.pod_list(), cluster.agents, now + 600).actions == ()


def test_a_pod_failed_by_its_node_is_replaced_without_counting() -> None:
    cluster = Cluster(job_object(nodes=2, min_nodes=1))
    settle(cluster)
    cluster.pods["demo-node-0"] = PodView(
        "demo-node-0", 0, PodPhase.FAILED, status_reason="Evicted"
    )
    cluster.pods["demo-node-1"] = PodView(
        "demo-node-1", 1, PodPhase.FAILED, ended="ContainerStatusUnknown, exit code 137"
    )
    d = run(cluster.job, cluster.pod_list(), cluster.agents)
    assert len(d.of(DeletePod)) == 2 and [c.index for c in d.of(CreatePod)] == [2, 3]
    assert "podFailures" not in d.status


def test_failures_age_out_of_the_window() -> None:
    policy = Policy.of(FailurePolicy(window_s=60), CONFIG)
    old = {"cause": "CrashLoop", "time": format_time(T0), "reason": "Error, exit code 1"}
    alien = {"cause": "Meteor", "time": format_time(T0)}
    status = {"podFailures": [old, alien], "createBackoffUntil": format_time(T0 + 4)}
    assert len(Ledger.of(status, T0 + 59, policy).entries) == 1
    later = Ledger.of(status, T0 + 61, policy)
    assert later.entries == [] and later.status_fields() == {
        "podFailures": None,
        "createBackoffUntil": None,
    }
    assert [policy.delay(n) for n in range(0, 5)] == [0, 1, 2, 4, 8]
    assert Policy.of(FailurePolicy(), CONFIG).delay(40) == CONFIG.backoff_max_s


def test_the_reconcile_loop_itself_backs_off_and_wakes_when_the_backoff_ends() -> None:
    assert [retry_delay(n, 5.0) for n in (1, 2, 3, 4, 9)] == [1, 2, 4, 5, 5]
    assert next_wait(5.0, None, T0) == 5.0
    assert next_wait(5.0, T0 + 2, T0) == 2.0
    assert next_wait(5.0, T0 + 60, T0) == 5.0
    assert next_wait(5.0, T0 - 1, T0) == 5.0  # over: nothing to wake for
    assert next_wait(5.0, T0 + 0.01, T0) == 0.05


def test_pod_view_reads_why_a_pod_does_not_run() -> None:
    obj = {
        "metadata": {"name": "demo-node-0", "labels": {"keepstep.dev/node-index": "0"},
                     "creationTimestamp": "2023-11-14T22:13:20Z"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"state": {"waiting": {
                "reason": "CreateContainerConfigError", "message": 'secret "s" not found'}}}],
        },
    }  # fmt: skip
    view = PodView.from_object(obj, "uid")
    assert view is not None and view.created_at == T0
    assert PodView.from_object(pod_summary(obj), "uid") == view  # what the cache keeps
    assert (view.waiting, view.waiting_message) == (
        "CreateContainerConfigError",
        'secret "s" not found',
    )
    obj["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/3 nodes are available"}],
    }  # fmt: skip
    view = PodView.from_object(obj, "uid")
    assert view is not None and view.waiting == "Unschedulable"
    obj["status"] = {
        "phase": "Failed",
        "reason": "Evicted",
        "containerStatuses": [{"state": {"terminated": {"reason": "Error", "exitCode": 3}}}],
    }
    view = PodView.from_object(obj, "uid")
    assert view is not None and (view.ended, view.status_reason) == (
        "Error, exit code 3",
        "Evicted",
    )


def test_a_backoff_that_is_over_is_cleared_once_even_with_nothing_to_create() -> None:
    cluster = Cluster(job_object(nodes=2, min_nodes=1))
    settle(cluster)
    crash(cluster, 0)
    crash(cluster, 1)
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents))
    assert cluster.obj["status"]["createBackoffUntil"] == format_time(T0 + 1)
    cluster.obj["spec"]["suspend"] = True  # nothing to create any more
    cluster.apply(run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 0.5))
    assert "createBackoffUntil" in cluster.obj["status"]
    d = run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 2)
    assert d.actions and "createBackoffUntil" not in d.status
    cluster.apply(d)
    assert run(cluster.job, cluster.pod_list(), cluster.agents, T0 + 3).actions == ()
