"""The Helm chart (manifests/helm/keepstep) with the real helm that e2e/controlplane/build
compiles: `helm lint` passes, the default values render the objects of manifests/ (the
cluster-wide install) and `watchNamespaces` those of manifests/namespaced/, object for object
once helm's own labels are set aside; the values change what they say (release name, external
etcd, images, metrics, the agents' telemetry defaults), and bad values fail `helm template`
with a message that names the value. Nothing here needs an API server:
tests/e2e/test_install.py installs manifests/ on one.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment
from openapi_check import MANIFESTS, load_all

from keepstep.e2e.controlplane import build_binaries
from keepstep.e2e.procs import StartupError
from keepstep.operator.__main__ import parse_args
from keepstep.operator.agent_defaults import AGENT_ENV_NAMES, EXPORTERS

pytestmark = pytest.mark.e2e

CHART = MANIFESTS / "helm" / "keepstep"
RELEASE = "keepstep"
NAMESPACE = "keepstep-system"
# What the chart adds to every object's labels (and its selectors, to keep releases apart).
HELM_LABELS = frozenset(
    {
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
        "app.kubernetes.io/managed-by",
        "helm.sh/chart",
    }
)
# The cluster-wide install, when manifests/kustomization.yaml is not there to say it.
INSTALL_FILES = (
    "namespace.yaml",
    "crd/trainjob.yaml",
    "rbac.yaml",
    "user-roles.yaml",
    "etcd.yaml",
    "operator.yaml",
)
DIGEST = "sha256:" + "ab" * 32

Key = tuple[str, str, str]  # kind, namespace ("" when cluster-scoped), name
Render = Callable[..., dict[Key, dict[str, Any]]]
Helm = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    """The folder of the built helm and kubectl (cached by the build script)."""
    try:
        return build_binaries()
    except StartupError as err:
        pytest.fail(f"e2e/controlplane/build did not give helm: {err}")


@pytest.fixture(scope="session")
def helm(bin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Runs the built helm with its homes in a temporary folder and no cluster, so nothing
    of the user's helm or kubectl configuration takes part; returns what it printed."""
    home = tmp_path_factory.mktemp("helm")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    env |= {f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    env["KUBECONFIG"] = str(home / "no-kubeconfig")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / "helm"), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env=env,
        )

    return run


def by_key(docs: Iterable[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for doc in docs:
        meta = doc["metadata"]
        key = (doc["kind"], meta.get("namespace", ""), meta["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = doc
    return out


def template(
    helm: Helm, *values: str, release: str = RELEASE, namespace: str = NAMESPACE
) -> subprocess.CompletedProcess[str]:
    """`helm template` with the CRD; `values` are helm's flags (`--set`, ...)."""
    return helm("template", release, str(CHART), "-n", namespace, "--include-crds", *values)


@pytest.fixture(scope="session")
def render(helm: Helm) -> Render:
    """The rendered objects by (kind, namespace, name); the test fails if helm does. Each
    rendering runs once per session (tests get copies)."""

    @functools.cache
    def rendered_once(values: tuple[str, ...], release: str, namespace: str) -> str:
        done = template(helm, *values, release=release, namespace=namespace)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def rendered(
        *values: str, release: str = RELEASE, namespace: str = NAMESPACE
    ) -> dict[Key, dict[str, Any]]:
        text = rendered_once(values, release, namespace)
        return by_key(d for d in yaml.safe_load_all(text) if d)

    return rendered


def without_helm_labels(value: Any) -> Any:
    """`value` with the chart's extra labels removed wherever a label map appears (metadata,
    pod templates, selectors), and the namespace's keep annotation."""
    if isinstance(value, dict):
        out = {k: without_helm_labels(v) for k, v in value.items() if k not in HELM_LABELS}
        annotations = out.get("annotations")
        if isinstance(annotations, dict):
            annotations.pop("helm.sh/resource-policy", None)
            if not annotations:
                del out["annotations"]
        return out
    if isinstance(value, list):
        return [without_helm_labels(v) for v in value]
    return value


def manifests_install(bin_dir: Path) -> dict[Key, dict[str, Any]]:
    """What `kubectl apply -k manifests/` applies: `kubectl kustomize`'s output, or the files
    it lists read directly where there is no kustomization.yaml."""
    if (MANIFESTS / "kustomization.yaml").exists():
        done = subprocess.run(
            [str(bin_dir / "kubectl"), "kustomize", str(MANIFESTS)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return by_key(d for d in yaml.safe_load_all(done.stdout) if d)
    return by_key(d for file in INSTALL_FILES for d in load_all(MANIFESTS / file))


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two parsed documents differ, as `.spec.template...: ours != theirs` lines."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for k in sorted(ours.keys() | theirs.keys()):
            if k in ours and k in theirs:
                out += differences(ours[k], theirs[k], f"{path}.{k}")
            else:
                out.append(
                    f"{path}.{k}: {ours.get(k, '<absent>')!r} != {theirs.get(k, '<absent>')!r}"
                )
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [
            d
            for i, pair in enumerate(zip(ours, theirs, strict=True))
            for d in differences(*pair, f"{path}[{i}]")
        ]
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def assert_same_objects(ours: dict[Key, Any], theirs: dict[Key, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, doc in theirs.items():
        diff = differences(without_helm_labels(ours[key]), doc)
        assert not diff, f"{key} differs (chart != manifests):\n" + "\n".join(diff)


def operator_container(
    objects: dict[Key, dict[str, Any]], namespace: str = NAMESPACE
) -> dict[str, Any]:
    deployment = objects[("Deployment", namespace, "keepstep-operator")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def flags(container: dict[str, Any]) -> dict[str, str]:
    """The operator's `--flag value` pairs."""
    args = container["args"]
    return dict(zip(args[::2], args[1::2], strict=True))


def test_helm_lint_passes_in_both_installs(helm: Helm) -> None:
    for values in ([], ["--set", "watchNamespaces={team-a,team-b}"]):
        done = helm("lint", "--strict", str(CHART), *values)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_chart_crd_is_the_manifests_crd() -> None:
    """helm installs crds/ verbatim (never templated): a copy that must not drift."""
    ours = (CHART / "crds" / "trainjob.yaml").read_bytes()
    assert ours == (MANIFESTS / "crd" / "trainjob.yaml").read_bytes(), (
        "cp manifests/crd/trainjob.yaml manifests/helm/keepstep/crds/trainjob.yaml"
    )
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["trainjob.yaml"]


def test_default_values_render_the_manifests_install(render: Render, bin_dir: Path) -> None:
    """Namespace aside: helm needs the release's namespace before it installs."""
    theirs = manifests_install(bin_dir)
    ours = render()
    assert ("Namespace", "", NAMESPACE) not in ours
    theirs.pop(("Namespace", "", NAMESPACE))
    assert_same_objects(ours, theirs)


def test_namespace_create_renders_the_manifests_namespace(render: Render, bin_dir: Path) -> None:
    ours = render("--set", "namespace.create=true")
    assert_same_objects(ours, manifests_install(bin_dir))
    namespace = ours[("Namespace", "", NAMESPACE)]
    assert namespace["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_watch_namespaces_renders_the_namespaced_install(render: Render) -> None:
    files = ["crd/trainjob.yaml", "user-roles.yaml", "etcd.yaml"]
    files += ["namespaced/operator.yaml", "namespaced/rbac.yaml"]
    theirs = by_key(d for file in files for d in load_all(MANIFESTS / file))
    watched = theirs[("Role", "team-a", "keepstep-operator")]["metadata"]["namespace"]
    assert_same_objects(render("--set", f"watchNamespaces={{{watched}}}"), theirs)


def test_each_watched_namespace_gets_a_role_and_nothing_else_is_cluster_wide(
    render: Render,
) -> None:
    ours = render("--set", "watchNamespaces={team-a,team-b}")
    for namespace in ("team-a", "team-b"):
        binding = ours[("RoleBinding", namespace, "keepstep-operator")]
        assert binding["roleRef"]["name"] == "keepstep-operator"
        assert ("Role", namespace, "keepstep-operator") in ours
    assert flags(operator_container(ours))["--namespace"] == "team-a,team-b"
    cluster_scoped = {(kind, name) for kind, namespace, name in ours if not namespace}
    assert cluster_scoped == {
        ("CustomResourceDefinition", "trainjobs.keepstep.dev"),
        ("ClusterRole", "keepstep-trainjob-editor"),
        ("ClusterRole", "keepstep-trainjob-viewer"),
    }


def test_another_release_names_everything_after_itself(render: Render) -> None:
    """Two releases never collide on a cluster-scoped name (the CRD is shared: helm skips
    crds/ when the CRD exists); the etcd URLs and names follow the release."""
    first = render()
    ours = render(release="research", namespace="research-system")
    shared = {key for key in first.keys() & ours.keys() if not key[1]}
    assert shared == {("CustomResourceDefinition", "", "trainjobs.keepstep.dev")}
    assert {namespace for _, namespace, _ in ours} == {"", "research-system"}
    prefixed = {name for kind, _, name in ours if kind != "CustomResourceDefinition"}
    assert all(name.startswith("research-keepstep-") for name in prefixed), prefixed
    deployment = ours[("Deployment", "research-system", "research-keepstep-operator")]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    etcd = "research-keepstep-etcd"
    assert flags(container) == {
        "--etcd": f"https://{etcd}.research-system.svc:2379",
        "--health": "http://0.0.0.0:8080/healthz",
        "--metrics": "http://0.0.0.0:8081/metrics",
        "--etcd-ca-secret": f"research-system/{etcd}-ca",
        "--etcd-server-secret": f"{etcd}-server",
        "--etcd-server-names": f"{etcd}.research-system.svc,*.{etcd}-peers.research-system.svc",
    }
    binding = ours[("ClusterRoleBinding", "", "research-keepstep-operator")]
    assert binding["subjects"][0]["namespace"] == "research-system"
    sts = ours[("StatefulSet", "research-system", etcd)]["spec"]
    assert sts["serviceName"] == f"{etcd}-peers"
    assert sts["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "research"
    args = sts["template"]["spec"]["containers"][0]["args"]
    assert f"--initial-cluster-token={etcd}" in args
    (secret,) = sts["template"]["spec"]["volumes"]
    assert secret["secret"]["secretName"] == f"{etcd}-server"


def etcd_members(objects: dict[Key, dict[str, Any]]) -> list[str]:
    sts = objects[("StatefulSet", NAMESPACE, "keepstep-etcd")]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    (cluster,) = [a.removeprefix("--initial-cluster=") for a in args if "-cluster=" in a]
    return [member.split("=")[0] for member in cluster.split(",")]


def test_etcd_replicas_storage_and_resources(render: Render) -> None:
    ours = render(
        "--set", "etcd.replicas=5", "--set", "etcd.storage.size=10Gi",
        "--set", "etcd.storage.storageClassName=fast-ssd",
        "--set", "etcd.resources.limits.memory=2Gi",
    )  # fmt: skip
    spec = ours[("StatefulSet", NAMESPACE, "keepstep-etcd")]["spec"]
    assert spec["replicas"] == 5
    assert etcd_members(ours) == [f"keepstep-etcd-{i}" for i in range(5)]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    (container,) = spec["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["memory"] == "2Gi"


def test_an_external_etcd_renders_no_statefulset_and_points_the_operator_at_it(
    render: Render,
) -> None:
    endpoint = "https://etcd.infra.svc:2379"
    values = ["--set", "etcd.enabled=false", "--set", f"etcd.endpoints={{{endpoint}}}"]
    ours = render(*values, "--set", "etcd.caSecret=infra/etcd-ca")
    assert not {kind for kind, _, _ in ours} & {"StatefulSet", "Service", "PodDisruptionBudget"}
    assert flags(operator_container(ours)) == {
        "--etcd": endpoint,
        "--health": "http://0.0.0.0:8080/healthz",
        "--metrics": "http://0.0.0.0:8081/metrics",
        "--etcd-ca-secret": "infra/etcd-ca",  # no server certificate: its owner makes it
    }
    # Namespaced: the operator may read and make the CA Secret where it is, nowhere else.
    namespaced = render(
        *values, "--set", "etcd.caSecret=infra/etcd-ca", "--set", "watchNamespaces={a}"
    )
    role = namespaced[("Role", "infra", "keepstep-operator-etcd-tls")]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get"]}
    ]
    # Without a CA: plain etcd, no etcd Secrets at all.
    plain = render(*values, "--set", "watchNamespaces={a}")
    assert "--etcd-ca-secret" not in flags(operator_container(plain))
    assert not [key for key in plain if key[2].endswith("-etcd-tls")]


def test_images_take_a_tag_a_digest_a_pull_policy_and_pull_secrets(render: Render) -> None:
    ours = render(
        "--set", f"operator.image.digest={DIGEST}", "--set", "operator.image.pullPolicy=Always",
        "--set", "operator.image.repository=registry.example.com:5000/ml/keepstep-operator",
        "--set", "etcd.image.tag=v3.6.17", "--set", "imagePullSecrets={regcred}",
    )  # fmt: skip
    container = operator_container(ours)
    assert container["image"] == f"registry.example.com:5000/ml/keepstep-operator@{DIGEST}"
    assert container["imagePullPolicy"] == "Always"
    sts = ours[("StatefulSet", NAMESPACE, "keepstep-etcd")]["spec"]["template"]["spec"]
    assert sts["containers"][0]["image"] == "quay.io/coreos/etcd:v3.6.17"
    assert "imagePullPolicy" not in sts["containers"][0]  # Kubernetes' default
    deployment = ours[("Deployment", NAMESPACE, "keepstep-operator")]["spec"]["template"]
    for pod in (deployment["spec"], sts):
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    tagged = render("--set", "operator.image.tag=0.2.0")
    assert operator_container(tagged)["image"] == "keepstep/operator:0.2.0"


def test_metrics_port_extra_args_and_replicas(render: Render) -> None:
    ours = render(
        "--set", "metrics.port=9100", "--set", "operator.replicas=0",
        "--set", "operator.extraArgs={--pending-grace,600}",
    )  # fmt: skip
    container = operator_container(ours)
    assert flags(container)["--metrics"] == "http://0.0.0.0:9100/metrics"
    assert container["args"][-2:] == ["--pending-grace", "600"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9100}
    assert ours[("Deployment", NAMESPACE, "keepstep-operator")]["spec"]["replicas"] == 0
    off = operator_container(render("--set", "metrics.enabled=false"))
    assert "--metrics" not in off["args"]
    assert [p["name"] for p in off["ports"]] == ["health"]


def agent_env(container: dict[str, Any]) -> list[str]:
    """The operator's --agent-env values, in order."""
    args = container["args"]
    return [value for flag, value in itertools.pairwise(args) if flag == "--agent-env"]


def test_telemetry_values_become_the_agents_defaults(render: Render) -> None:
    """The chart's telemetry is every job's agents': --agent-env flags of the operator
    (a job's own trainer.env wins), none while the values are empty; the operator's own
    environment gets no OTEL_* variable."""
    assert agent_env(operator_container(render())) == []
    ours = operator_container(
        render(
            "--set", "telemetry.exporters={otlp,prometheus}",
            "--set", "telemetry.otlpEndpoint=http://otel-collector.monitoring:4318",
            "--set", "telemetry.prometheusPort=9100",
            "--set-json", "telemetry.interval=2.5",
            "--set", "agentEnv.KEEPSTEP_S3_ENDPOINT=http://minio.storage:9000",
            "--set", "agentEnv.KEEPSTEP_REPLY_TIMEOUT=60",
            "--set", "operator.extraArgs={--pending-grace,600}",
        )
    )  # fmt: skip
    assert agent_env(ours) == [
        "KEEPSTEP_TELEMETRY=otlp,prometheus",
        "OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector.monitoring:4318",
        "KEEPSTEP_TELEMETRY_PORT=9100",
        "KEEPSTEP_TELEMETRY_INTERVAL=2.5",
        "KEEPSTEP_REPLY_TIMEOUT=60",  # agentEnv by name
        "KEEPSTEP_S3_ENDPOINT=http://minio.storage:9000",
    ]
    assert ours["args"][-2:] == ["--pending-grace", "600"]  # extraArgs stay last
    assert not [e for e in ours["env"] if e["name"].startswith("OTEL_")]
    # What the chart renders, the operator accepts.
    flags = [f for value in agent_env(ours) for f in ("--agent-env", value)]
    settings, _ = parse_args(["--etcd", "http://e:2379", *flags])
    assert dict(settings.agent_env)["KEEPSTEP_TELEMETRY_PORT"] == "9100"


def test_the_schema_allows_exactly_the_names_the_operator_defaults() -> None:
    """telemetry's values cover four names, agentEnv the rest of the operator's list."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    telemetry = {
        "KEEPSTEP_TELEMETRY", "OTEL_EXPORTER_OTLP_ENDPOINT", "KEEPSTEP_TELEMETRY_PORT",
        "KEEPSTEP_TELEMETRY_INTERVAL",
    }  # fmt: skip
    names = schema["properties"]["agentEnv"]["propertyNames"]["enum"]
    assert not telemetry & set(names)
    assert sorted([*telemetry, *names]) == sorted(AGENT_ENV_NAMES)
    exporters = schema["properties"]["telemetry"]["properties"]["exporters"]["items"]["enum"]
    assert exporters == list(EXPORTERS)


def test_user_roles_can_be_left_out(render: Render) -> None:
    ours = render("--set", "userRoles.enabled=false")
    assert not [name for kind, _, name in ours if "trainjob-" in name]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["etcd.replicas=2"], r"/etcd/replicas.*one of"),
        (["operator.image.tag=0.1 0"], r"/operator/image/tag.*does not match pattern"),
        (["watchNamespaces=team-a"], r"/watchNamespaces.*got string, want array"),
        (["watchNamespaces={Team_A}"], r"/watchNamespaces/0.*does not match pattern"),
        (["operator.image.digest=sha256:abc"], r"/operator/image/digest.*does not match"),
        (["operator.replicas=2"], r"/operator/replicas.*maximum"),
        (["etcd.replica=3"], r"/etcd.*additional properties 'replica' not allowed"),
        (["etcd.endpoints={etcd:2379}"], r"/etcd/endpoints/0.*does not match pattern"),
        (["etcd.enabled=false"], r"etcd\.endpoints: etcd\.enabled is false"),
        (["etcd.endpoints={https://e.infra.svc:2379}"], r"etcd\.endpoints \(https://e\.infra"),
        (["etcd.caSecret=infra/ca"], r"etcd\.caSecret \(infra/ca\).*release's namespace"),
        (["metrics.port=8080"], r"metrics\.port \(8080\) must differ from operator\.healthPort"),
        (["telemetry.exporters={statsd}"], r"/telemetry/exporters/0.*one of 'otlp'"),
        (["telemetry.exporters=otlp"], r"/telemetry/exporters.*got string, want array"),
        (["telemetry.otlpEndpoint=collector:4318"], r"/telemetry/otlpEndpoint.*pattern"),
        (["telemetry.prometheusPort=70000"], r"/telemetry/prometheusPort.*maximum"),
        (["telemetry.interval=-1"], r"/telemetry/interval.*minimum"),
        (["telemetry.headersSecret.name=otlp"], r"/telemetry.*'headersSecret' not allowed"),
        (["agentEnv.KEEPSTEP_JOB=x"], r"invalid propertyName 'KEEPSTEP_JOB'"),
        (["agentEnv.KEEPSTEP_TELEMETRY=otlp"], r"invalid propertyName 'KEEPSTEP_TELEMETRY'"),
    ],
)
def test_bad_values_fail_with_a_message_that_names_the_value(
    helm: Helm, values: list[str], message: str
) -> None:
    done = template(helm, *(f for v in values for f in ("--set", v)))
    assert done.returncode != 0, f"{values} rendered"
    assert re.search(message, done.stderr), done.stderr


def test_a_release_name_too_long_for_the_etcd_names_fails(helm: Helm) -> None:
    done = template(helm, release="a-very-long-release-name-for-the-ml-team")
    assert done.returncode != 0
    assert "at most 40" in done.stderr, done.stderr
