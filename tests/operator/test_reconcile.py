"""One reconcile wired end to end over fakes: an in-memory API server and the KV fake.

The real API server and etcd are in tests/e2e/test_operator.py; here the wiring is checked
fast: what is read, what is written, and that a repeat writes nothing.
"""

from __future__ import annotations

import copy
from typing import Any

from fake_kube import FakeKube
from op_builders import ETCD, T0, UID, job_object

from keepstep.agent import protocol
from keepstep.agent.kv.memory import MemoryKV
from keepstep.operator.agents import AgentStore
from keepstep.operator.model import Job
from keepstep.operator.podspec import pod_manifest
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import DecideConfig


def setup(**job: Any) -> tuple[FakeKube, MemoryKV, Reconciler]:
    kube, kv = FakeKube(), MemoryKV()
    kube.jobs["demo"] = job_object(**job)
    reconciler = Reconciler(kube, AgentStore(kv, 0.5), DecideConfig(ETCD), clock=lambda: T0)
    return kube, kv, reconciler


def test_first_reconcile_acts_and_the_next_one_only_reads() -> None:
    kube, kv, reconciler = setup(nodes=3)
    first = reconciler.reconcile("ns", "demo")
    assert sorted(kube.pods) == ["demo-node-0", "demo-node-1", "demo-node-2"]
    assert kube.services == {"demo"}
    policy = kube.policies["demo"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"keepstep.dev/job": "demo"}}
    assert kube.jobs["demo"]["status"]["nextPodIndex"] == 3
    assert first.tally.reads == 4 and first.tally.calls["CreatePod"] == 3
    assert first.etcd_writes == 1 and first.resource_version == "1"
    owner = kv.get(protocol.key("ns.demo", "operator"), 0.5)
    assert owner is not None and b'"uid": "uid-1"' in owner.value
    again = reconciler.reconcile("ns", "demo")
    assert again.decision.actions == ()
    assert (again.tally.reads, again.tally.writes) == (4, 0)
    assert dict(again.tally.calls) == {
        "get_job": 1,
        "list_pods": 1,
        "get_service": 1,
        "get_network_policy": 1,
    }
    assert (again.etcd_reads, again.etcd_writes) == (1, 0)
    assert again.resource_version is None


def test_pods_of_another_job_with_the_same_name_are_not_counted() -> None:
    kube, _, reconciler = setup(nodes=2)
    stale = copy.deepcopy(job_object())
    stale["metadata"]["uid"] = "uid-0"
    kube.pods["demo-node-0"] = pod_manifest(Job.from_object(stale), 0, ETCD)
    reconciler.reconcile("ns", "demo")
    # The stale pod is not ours (owner uid differs) and its name is not reused.
    assert sorted(kube.pods) == ["demo-node-0", "demo-node-1", "demo-node-2"]
    assert kube.pods["demo-node-0"]["metadata"]["ownerReferences"][0]["uid"] == "uid-0"
    assert kube.pods["demo-node-1"]["metadata"]["ownerReferences"][0]["uid"] == UID
    assert reconciler.reconcile("ns", "demo").decision.actions == ()


def test_etcd_down_still_replaces_pods_and_keeps_the_figures() -> None:
    kube, kv, reconciler = setup(nodes=2, min_nodes=1)
    reconciler.reconcile("ns", "demo")
    kube.jobs["demo"]["status"]["step"] = 12
    kv.set_unavailable(True)
    del kube.pods["demo-node-0"]
    outcome = reconciler.reconcile("ns", "demo")
    assert sorted(kube.pods) == ["demo-node-1", "demo-node-2"]
    assert kube.jobs["demo"]["status"]["step"] == 12
    assert outcome.etcd_writes == 0


def test_an_invalid_spec_is_reported_and_a_missing_job_is_gone() -> None:
    kube, _, reconciler = setup()
    kube.jobs["demo"]["spec"]["elasticPolicy"]["microBatchSize"] = 5
    outcome = reconciler.reconcile("ns", "demo")
    assert kube.jobs["demo"]["status"]["phase"] == "Failed"
    assert "microBatchSize=5" in outcome.decision.reason
    assert not kube.pods
    assert reconciler.reconcile("ns", "nope").gone


def test_a_lagging_pod_cache_does_not_make_duplicates() -> None:
    kube, _, reconciler = setup(nodes=3)
    reconciler.reconcile("ns", "demo", pods=[])
    assert len(kube.pods) == 3
    # The cache has not seen the three new pods yet: nothing more is created.
    again = reconciler.reconcile("ns", "demo", pods=[], mark=reconciler.expectations.mark())
    assert again.decision.actions == ()
    assert (again.tally.reads, again.tally.writes) == (3, 0)  # no pod list with a cache
    # The watch reports the new pods; then one is deleted by someone else and the cache
    # drops it: one replacement, index 3.
    for n in kube.pods:
        reconciler.expectations.observe(("ns", "demo", UID), n)
    cache = [p for n, p in kube.pods.items() if n != "demo-node-1"]
    del kube.pods["demo-node-1"]
    reconciler.reconcile("ns", "demo", pods=cache, mark=reconciler.expectations.mark())
    assert sorted(kube.pods) == ["demo-node-0", "demo-node-2", "demo-node-3"]
