"""Expectations: our own creates and deletes laid over a pod cache that lags behind them."""

from __future__ import annotations

from op_builders import ETCD, job, pod

from keepstep.operator.actions import Action, CreatePod, Decision, DeleteCause, DeletePod
from keepstep.operator.expect import Expectations
from keepstep.operator.model import PodPhase
from keepstep.operator.podspec import pod_manifest

JOB = ("ns", "demo", "uid-1")


def decision(creates: list[int], deletes: list[str]) -> Decision:
    j = job()
    actions: list[Action] = [
        *(CreatePod(i, pod_manifest(j, i, ETCD)) for i in creates),
        *(DeletePod(n, "test", DeleteCause.LOST) for n in deletes),
    ]
    return Decision(tuple(actions))


def test_created_pods_count_until_the_cache_shows_them() -> None:
    exp = Expectations(ttl_s=30, clock=lambda: 0.0)
    exp.record(JOB, decision([3, 4], []))
    view = exp.adjust(JOB, [pod(0)])
    assert [(p.name, p.phase) for p in view] == [
        ("demo-node-0", PodPhase.PENDING),
        ("demo-node-3", PodPhase.PENDING),
        ("demo-node-4", PodPhase.PENDING),
    ]
    # The cache caught up with pod 3: only pod 4 is still added.
    view = exp.adjust(JOB, [pod(0), pod(3, PodPhase.RUNNING)])
    assert [p.name for p in view] == ["demo-node-0", "demo-node-3", "demo-node-4"]
    assert view[1].phase is PodPhase.RUNNING  # the cache's view wins once it has the pod
    exp.adjust(JOB, [pod(0), pod(3), pod(4)])
    assert exp.adjust(JOB, [pod(0)]) == [pod(0)]  # nothing remembered any more


def test_deleted_pods_count_as_terminating_until_the_cache_drops_them() -> None:
    exp = Expectations(clock=lambda: 0.0)
    exp.record(JOB, decision([5], ["demo-node-1"]))
    view = {p.name: p for p in exp.adjust(JOB, [pod(0), pod(1)])}
    assert view["demo-node-1"].terminating and not view["demo-node-0"].terminating
    assert "demo-node-5" in view
    view = {p.name: p for p in exp.adjust(JOB, [pod(0), pod(5)])}
    assert sorted(view) == ["demo-node-0", "demo-node-5"]


def test_expectations_expire_and_are_per_job() -> None:
    now = [0.0]
    exp = Expectations(ttl_s=10, clock=lambda: now[0])
    exp.record(JOB, decision([2], []))
    assert exp.adjust(("ns", "demo", "uid-2"), []) == []  # a new job of the same name
    now[0] = 11.0
    assert exp.adjust(JOB, []) == []  # a create that never showed up is not masked forever
    exp.record(JOB, decision([3], []))
    exp.forget(JOB)
    assert exp.adjust(JOB, []) == []


def test_an_event_before_the_snapshot_settles_a_create_even_for_a_pod_gone_again() -> None:
    exp = Expectations(clock=lambda: 0.0)
    exp.record(JOB, decision([3], []))
    exp.observe(JOB, "demo-node-3")  # ADDED; then deleted by someone before any reconcile
    exp.observe(JOB, "demo-node-3")
    mark = exp.mark()
    assert exp.adjust(JOB, [pod(0)], mark) == [pod(0)]  # so it is replaced, not masked


def test_an_event_after_the_snapshot_does_not_count_for_it() -> None:
    # The snapshot was copied, then the watch delivered pod 3 while the reconcile ran:
    # the snapshot lacks pod 3, and it must still count (or a duplicate would be made).
    exp = Expectations(clock=lambda: 0.0)
    exp.record(JOB, decision([3], []))
    mark = exp.mark()
    exp.observe(JOB, "demo-node-3")
    assert [p.name for p in exp.adjust(JOB, [pod(0)], mark)] == ["demo-node-0", "demo-node-3"]
    # The next snapshot, taken after that event, shows it.
    assert exp.adjust(JOB, [pod(0), pod(3)], exp.mark()) == [pod(0), pod(3)]


def test_pods_the_api_server_refused_are_not_expected() -> None:
    exp = Expectations(ttl_s=30, clock=lambda: 0.0)
    exp.record(JOB, decision([3, 4], []))
    exp.dropped(JOB, ["demo-node-3"])
    assert [p.name for p in exp.adjust(JOB, [pod(0)])] == ["demo-node-0", "demo-node-4"]
    exp.dropped(("ns", "other", "uid-2"), ["demo-node-4"])  # another job: nothing to drop
    assert [p.name for p in exp.adjust(JOB, [pod(0)])] == ["demo-node-0", "demo-node-4"]
