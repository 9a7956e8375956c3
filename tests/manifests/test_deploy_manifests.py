"""The manifests that install keepstep, without an API server: the operator's RBAC is exactly
the least privilege manifests/README.md lists, in both installs (cluster-wide: rbac.yaml;
namespaced: namespaced/), the Deployment runs the operator under that ServiceAccount against
the etcd Service, the etcd StatefulSet's initial cluster is built from its own stable DNS
names, and the Dockerfiles install the right extras (the operator's has no torch).
tests/e2e/test_crd.py applies the same files to a real API server (dry run), and
tests/e2e/test_operator_safety.py runs the operator under the namespaced Role.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from typing import Any

import pytest
from openapi_check import MANIFESTS, REPO, load_all
from packaging.requirements import Requirement

NAMESPACE = "keepstep-system"
SERVICE_ACCOUNT = "keepstep-operator"

# (apiGroup, resource) -> verbs. Anything more is a finding; see manifests/README.md for why.
NAMESPACED_RULES = {
    ("keepstep.dev", "trainjobs"): {"get", "list", "watch", "patch"},
    ("keepstep.dev", "trainjobs/status"): {"patch"},
    ("", "pods"): {"create", "delete", "list", "watch"},
    ("", "services"): {"create", "get"},
    ("networking.k8s.io", "networkpolicies"): {"create", "get"},
    ("", "events"): {"create"},
    ("", "secrets"): {"create", "get"},
}
# Cluster-wide, kopf also follows the CRD (namespaced, it does not scan: settings.scanning).
OPERATOR_RULES = {
    **NAMESPACED_RULES,
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}


def objects(file: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in load_all(MANIFESTS / file)}


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no resourceNames etc.
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_operator_role_is_exactly_the_listed_least_privilege() -> None:
    role = objects("rbac.yaml")[("ClusterRole", "keepstep-operator")]
    assert rules_of(role) == OPERATOR_RULES
    namespaced = objects("namespaced/rbac.yaml")[("Role", "keepstep-operator")]
    assert rules_of(namespaced) == NAMESPACED_RULES


def test_readme_lists_every_verb_of_the_operator_and_why() -> None:
    """The README's RBAC table is the list: one row per resource, its verbs, a reason."""
    text = (MANIFESTS / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([a-z/]+)` \| ([a-z, ]+) \| (.+) \|$", text, re.MULTILINE)
    listed = {resource: set(verbs.split(", ")) for resource, verbs, why in rows if why.strip()}
    assert listed == {resource: verbs for (_, resource), verbs in OPERATOR_RULES.items()}


def test_no_role_uses_wildcards_or_grants_users_status() -> None:
    roles = [
        d
        for file in ("rbac.yaml", "user-roles.yaml", "namespaced/rbac.yaml")
        for d in load_all(MANIFESTS / file)
        if d["kind"] in ("ClusterRole", "Role")
    ]
    assert len(roles) == 4
    for role in roles:
        for (group, resource), verbs in rules_of(role).items():
            assert "*" not in (group, resource) and "*" not in verbs, role["metadata"]["name"]
    for name in ("keepstep-trainjob-editor", "keepstep-trainjob-viewer"):
        granted = rules_of(objects("user-roles.yaml")[("ClusterRole", name)])
        assert granted[("keepstep.dev", "trainjobs/status")] <= {"get", "list", "watch"}
        assert {g for g, _ in granted} == {"keepstep.dev"}


def test_binding_gives_the_role_to_the_operator_service_account() -> None:
    binding = objects("rbac.yaml")[("ClusterRoleBinding", "keepstep-operator")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "keepstep-operator",
    }
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
    assert binding["subjects"] == [subject]
    account = objects("operator.yaml")[("ServiceAccount", SERVICE_ACCOUNT)]
    assert account["metadata"]["namespace"] == NAMESPACE
    namespaced = objects("namespaced/rbac.yaml")[("RoleBinding", "keepstep-operator")]
    assert namespaced["roleRef"]["kind"] == "Role" and namespaced["subjects"] == [subject]
    watched = namespaced["metadata"]["namespace"]
    assert (
        objects("namespaced/rbac.yaml")[("Role", "keepstep-operator")]["metadata"]["namespace"]
        == watched
    )


def test_the_namespaced_operator_differs_only_by_the_namespaces_it_watches() -> None:
    cluster = objects("operator.yaml")
    namespaced = objects("namespaced/operator.yaml")
    # Besides: a Role in its own namespace for the etcd CA's Secrets (the ClusterRole has it).
    etcd_tls = {
        ("Role", "keepstep-operator-etcd-tls"),
        ("RoleBinding", "keepstep-operator-etcd-tls"),
    }
    assert namespaced.keys() == cluster.keys() | etcd_tls
    role = namespaced[("Role", "keepstep-operator-etcd-tls")]
    assert rules_of(role) == {("", "secrets"): {"create", "get"}}
    assert (
        namespaced[("ServiceAccount", SERVICE_ACCOUNT)]
        == cluster[("ServiceAccount", SERVICE_ACCOUNT)]
    )
    ours = namespaced[("Deployment", "keepstep-operator")]
    (container,) = ours["spec"]["template"]["spec"]["containers"]
    watched = objects("namespaced/rbac.yaml")[("Role", "keepstep-operator")]["metadata"][
        "namespace"
    ]
    assert container["args"][-2:] == ["--namespace", watched]
    container["args"] = container["args"][:-2]
    assert ours == cluster[("Deployment", "keepstep-operator")]


def test_every_namespaced_object_is_in_the_keepstep_namespace() -> None:
    (namespace,) = load_all(MANIFESTS / "namespace.yaml")
    assert namespace["metadata"]["name"] == NAMESPACE
    for file in ("operator.yaml", "etcd.yaml", "namespaced/operator.yaml"):
        for doc in load_all(MANIFESTS / file):
            assert doc["metadata"]["namespace"] == NAMESPACE, (file, doc["metadata"]["name"])


def test_operator_deployment_runs_the_operator_against_the_etcd_service() -> None:
    deployment = objects("operator.yaml")[("Deployment", "keepstep-operator")]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == SERVICE_ACCOUNT
    (container,) = pod["containers"]
    argv = container["command"] + container["args"]
    assert argv[:4] == ["python", "-m", "keepstep.operator", "--etcd"]
    url = re.fullmatch(r"https://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", argv[4])
    assert url is not None and argv[5:7] == ["--health", "http://0.0.0.0:8080/healthz"], argv
    assert argv[7:9] == ["--metrics", "http://0.0.0.0:8081/metrics"], argv
    # TLS: the CA and the members' certificate in the etcd's namespace, for the names the
    # client URL and the peers' URLs use.
    tls = dict(zip(argv[9::2], argv[10::2], strict=True))
    assert tls["--etcd-ca-secret"] == f"{NAMESPACE}/keepstep-etcd-ca"
    names = tls["--etcd-server-names"].split(",")
    assert f"{url[1]}.{url[2]}.svc" in names
    assert f"*.keepstep-etcd-peers.{NAMESPACE}.svc" in names
    sts = objects("etcd.yaml")[("StatefulSet", "keepstep-etcd")]["spec"]["template"]["spec"]
    (volume,) = sts["volumes"]
    assert volume["secret"]["secretName"] == tls["--etcd-server-secret"]
    # The liveness and readiness probes ask kopf's endpoint, on the port it serves; the
    # metrics port is the one --metrics names (a PodMonitor scrapes it by name).
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    service = objects("etcd.yaml")[("Service", url[1])]
    assert url[2] == service["metadata"]["namespace"]
    assert int(url[3]) in {p["port"] for p in service["spec"]["ports"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_etcd_initial_cluster_is_built_from_the_stable_dns_names() -> None:
    etcd = objects("etcd.yaml")
    sts = etcd[("StatefulSet", "keepstep-etcd")]
    spec = sts["spec"]
    peers = etcd[("Service", spec["serviceName"])]
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    assert peers["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = spec["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["name"]: p["port"] for p in peers["spec"]["ports"]} == ports
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    host = "{pod}." + spec["serviceName"] + ".$(POD_NAMESPACE).svc"
    members = [f"{sts['metadata']['name']}-{i}" for i in range(spec["replicas"])]
    expected = [f"{m}=https://{host.format(pod=m)}:{ports['peer']}" for m in members]
    assert flags["initial-cluster"].split(",") == expected
    assert flags["name"] == "$(POD_NAME)"
    assert flags["initial-advertise-peer-urls"] == f"https://{host.format(pod='$(POD_NAME)')}:2380"
    assert flags["advertise-client-urls"] == f"https://{host.format(pod='$(POD_NAME)')}:2379"
    assert flags["client-cert-auth"] == flags["peer-client-cert-auth"] == "true"
    assert flags["initial-cluster-state"] == "new"
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    (claim,) = spec["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["data-dir"].startswith(mounts[claim["metadata"]["name"]] + "/")


def dependency_closure(requirements: list[str]) -> set[str]:
    """Names of the installed distributions a pip install of these requirements would pull in."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        for spec in dist.requires or []:
            dep = Requirement(spec)
            extras = ["", *sorted(req.extras)]
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return seen


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    with (REPO / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def test_operator_extra_pulls_in_no_torch(project: dict[str, Any]) -> None:
    base = project["dependencies"]
    operator = dependency_closure(base + project["optional-dependencies"]["operator"])
    assert {"kopf", "kubernetes", "etcd-sdk-python"} <= operator
    assert not operator & {"torch", "numpy", "nvidia-cudnn-cu12", "triton"}, sorted(operator)
    train = dependency_closure(base + project["optional-dependencies"]["train"])
    assert "torch" in train  # the same walk does find torch where it belongs


def dockerfile(name: str) -> list[str]:
    """The instructions of a Dockerfile, continuations joined, comments dropped."""
    text = (MANIFESTS / "docker" / name).read_text(encoding="utf-8").replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and line[0] != "#"]


PINNED_BASE = next(
    line for line in dockerfile("agent.Dockerfile") if line.startswith("ARG PYTHON_IMAGE=python:")
)


def test_agent_image_installs_train_extra_as_non_root() -> None:
    lines = dockerfile("agent.Dockerfile")
    assert lines[:2] == [PINNED_BASE, "FROM ${PYTHON_IMAGE}"]  # digest: tests/test_wheel.py
    assert any('".[train]"' in line for line in lines if line.startswith("RUN"))
    assert lines[-2:] == ['ENTRYPOINT ["keepstep"]', 'CMD ["--help"]']
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root")), users
    assert "COPY examples/ examples/" in lines  # the samples' training scripts


def test_agent_image_keeps_its_caches_where_a_read_only_pod_can_write() -> None:
    from keepstep.operator.template import MOUNTS

    writable = [m["mountPath"] for m in MOUNTS]
    env = dict(
        pair.split("=", 1)
        for line in dockerfile("agent.Dockerfile")
        if line.startswith("ENV ")
        for pair in line.removeprefix("ENV ").split()
    )
    for name in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert any(env[name].startswith(path + "/") for path in writable), (name, env[name])


def test_operator_image_has_no_torch_and_checks_it() -> None:
    lines = dockerfile("operator.Dockerfile")
    assert lines[:2] == [PINNED_BASE, "FROM ${PYTHON_IMAGE}"]
    runs = " ".join(line for line in lines if line.startswith("RUN"))
    assert '".[operator]"' in runs and "[train]" not in runs
    assert "pip check" in runs and "find_spec" in runs and "'torch'" in runs
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root")), users
    assert lines[-1] == 'ENTRYPOINT ["python", "-m", "keepstep.operator"]'
