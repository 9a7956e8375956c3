"""Each TrainJob's NetworkPolicy: only the job's own pods reach its pods.

- The policy selects the job's pods and admits ingress from the job's pods only (same
  namespace, any port: the agents' ports are chosen at start), from anywhere only to the
  agents' Prometheus port (named `metrics`), and leaves egress alone.
- A new job gets it before its first pod; a policy someone deleted is created again; a
  job that ended gets none; the client sends it to the networking API.
"""

from __future__ import annotations

from op_builders import Cluster, job, job_object, run, running, settle

from keepstep.operator.actions import CreatePod, EnsureNetworkPolicy, Event
from keepstep.operator.model import AgentView
from keepstep.operator.podspec import network_policy_manifest, pod_manifest

ETCD = "http://etcd:2379"


def test_the_policy_admits_only_the_jobs_own_pods() -> None:
    j = job(name="alpha")
    policy = network_policy_manifest(j)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    meta = policy["metadata"]
    assert (meta["name"], meta["namespace"]) == ("alpha", "ns")
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("TrainJob", "alpha", j.uid)
    own = {"matchLabels": {"keepstep.dev/job": "alpha"}}
    spec = policy["spec"]
    assert spec["podSelector"] == own
    assert spec["policyTypes"] == ["Ingress"]  # egress (etcd, storage) is not restricted
    metrics = {"ports": [{"protocol": "TCP", "port": "metrics"}]}  # any source, one port
    assert spec["ingress"] == [{"from": [{"podSelector": own}]}, metrics]  # no namespaceSelector
    # The policy's selector is what the job's pods carry, and nothing a template may set.
    labels = pod_manifest(j, 0, ETCD)["metadata"]["labels"]
    assert own["matchLabels"].items() <= labels.items()
    # The port it names is the one an agent serving Prometheus declares.
    on = job(name="alpha", env=[{"name": "KEEPSTEP_TELEMETRY", "value": "prometheus"}])
    (container,) = pod_manifest(on, 0, ETCD)["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["metrics"]


def test_a_new_job_gets_its_policy_before_any_pod() -> None:
    d = run(job(nodes=2), [], AgentView(), service_exists=False, policy_exists=False)
    assert d.of(EnsureNetworkPolicy) == [EnsureNetworkPolicy(network_policy_manifest(job()))]
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("EnsureNetworkPolicy") < kinds.index("EnsureService")
    assert kinds.index("EnsureService") < kinds.index("CreatePod")
    assert any(e.reason == "CreatedNetworkPolicy" for e in d.of(Event))
    assert "network policy missing" in d.reason


def test_a_deleted_policy_is_created_again_and_an_ended_job_gets_none() -> None:
    cluster = Cluster(job_object(nodes=2))
    settle(cluster)
    assert cluster.policy and cluster.service
    cluster.policy = False  # someone deleted it while the job runs
    cluster.pods = {f"demo-node-{i}": running(i) for i in range(2)}
    again = run(cluster.job, cluster.pod_list(), cluster.agents, policy_exists=False)
    assert len(again.of(EnsureNetworkPolicy)) == 1 and not again.of(CreatePod)
    ended = job(status={"phase": "Succeeded"})
    assert not run(ended, [], AgentView(), policy_exists=False).of(EnsureNetworkPolicy)
