"""Installing keepstep as a cluster admin would, on the real control plane: `kubectl apply -k
manifests/` with the real kubectl, and `helm install` of the chart with the helm built from
source; each time the operator that install describes runs the sample TrainJob to the end
with the fault-free parameters.

What a process-backed node cannot give a pod is supplied around the install, never by
changing what it renders. The nodes have no images, no Service network and no cluster DNS,
so the operator's Deployment runs at 0 replicas, and so does the bundled etcd's StatefulSet
(the kustomize overlay in install/ sets only that; the unchanged base is applied too, as a
server-side dry run; the chart is installed with an external etcd, one of its values). The
operator runs as a process of the test with the Deployment's own command, args and env,
exactly as installed, except:
- it acts with a token of the install's ServiceAccount (TokenRequest, `kubectl create
  token`) through a kubeconfig, so the RBAC the install grants is all it has;
- its etcd is a TLS etcd started here with a server certificate from the install's CA
  (made first, as cert-manager would, and valid for 127.0.0.1);
- an `http://0.0.0.0:PORT/...` address flag (health, metrics) listens on a free loopback
  port instead of the pod's port; the readiness probe's path is asked there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent.kv.etcd import EtcdCredentials
from keepstep.e2e.chaos_env import OperatorProcess
from keepstep.e2e.controlplane import ControlPlane, build_binaries
from keepstep.elastic.errors import ConfigError
from keepstep.launch.etcd_server import EtcdServer, find_etcd
from keepstep.launch.etcd_tls import ServerTLS
from keepstep.operator.connection import load_connection
from keepstep.operator.etcd_access import EtcdAuthority
from keepstep.operator.kube import Kube

from .helpers import REPO, wait_for
from .test_training import reference, succeeded, trainjob
from .training_fixtures import Training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

__all__ = ["reference"]  # the fixture, used below

OVERLAY = Path(__file__).parent / "install"
CHART = REPO / "manifests" / "helm" / "keepstep"
SYSTEM = "keepstep-system"
OPERATOR = "keepstep-operator"  # the Deployment and its ServiceAccount


@pytest.fixture
def kustomized(trainjob_crd: ControlPlane) -> Iterator[ControlPlane]:
    """The install applied with `kubectl apply -k`; its objects (but the CRD, which the
    other tests share) deleted afterwards."""
    cp = trainjob_crd
    applied = cp.kubectl("apply", "-k", str(OVERLAY), timeout=90)
    try:
        assert applied.returncode == 0, applied.stderr
        yield cp
    finally:
        built = cp.kubectl("kustomize", str(OVERLAY), check=True).stdout
        for kind, name in objects(built):
            if kind != "CustomResourceDefinition":
                cp.kubectl("delete", kind, name, "-n", SYSTEM, "--ignore-not-found", "--wait=false")


def objects(rendered: str) -> list[tuple[str, str]]:
    import yaml  # type: ignore[import-untyped]  # no stubs in the pinned environment

    return [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(rendered) if o]


@pytest.mark.timeout(300)
def test_kubectl_apply_k_installs_a_working_operator(
    kustomized: ControlPlane, namespace: str, tmp_path: Path, reference: str
) -> None:
    cp = kustomized
    # The base as users apply it, unchanged, is valid for the API server too.
    dry = cp.kubectl("apply", "-k", str(REPO / "manifests"), "--dry-run=server", timeout=60)
    assert dry.returncode == 0, dry.stderr
    deployment = get_deployment(cp, SYSTEM, OPERATOR)
    args = container_of(deployment)["args"]
    ca_ns, ca_name = flag(args, "--etcd-ca-secret").split("/")
    server_secret = flag(args, "--etcd-server-secret")
    with tls_etcd(cp, ca_ns, ca_name, server_secret, tmp_path) as (url, root):
        run_sample(cp, deployment, url, root, namespace, tmp_path, reference)


@pytest.fixture
def helm(trainjob_crd: ControlPlane, tmp_path: Path) -> Callable[..., str]:
    """The built helm against the control plane, with its homes in `tmp_path`."""
    home = tmp_path / "helm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    env |= {f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}
    env["KUBECONFIG"] = str(trainjob_crd.kubeconfig)

    def run(*args: str) -> str:
        done = subprocess.run(
            [str(build_binaries() / "helm"), *args],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
            env=env,
        )
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
        return done.stdout

    return run


@pytest.mark.timeout(300)
def test_helm_install_runs_a_working_operator(
    trainjob_crd: ControlPlane,
    helm: Callable[..., str],
    namespace: str,
    tmp_path: Path,
    reference: str,
) -> None:
    cp = trainjob_crd
    release, system = "kse2e", f"{namespace}-sys"
    cp.kubectl("create", "namespace", system, check=True)
    try:
        with tls_etcd(cp, system, "etcd-ca", "etcd-server", tmp_path) as (url, root):
            helm(
                "install", release, str(CHART), "-n", system,
                "--set", "operator.replicas=0", "--set", "etcd.enabled=false",
                "--set", f"etcd.endpoints={{{url}}}", "--set", "etcd.caSecret=etcd-ca",
            )  # fmt: skip
            try:
                assert "deployed" in helm("status", release, "-n", system)
                deployment = get_deployment(cp, system, f"{release}-keepstep-operator")
                run_sample(cp, deployment, url, root, namespace, tmp_path, reference)
            finally:
                helm("uninstall", release, "-n", system, "--wait", "--timeout", "60s")
    finally:
        cp.kubectl("delete", "namespace", system, "--wait=false")


def get_deployment(cp: ControlPlane, namespace: str, name: str) -> Any:
    done = cp.kubectl("-n", namespace, "get", "deployment", name, "-o", "json", check=True)
    deployment = json.loads(done.stdout)
    assert deployment["spec"]["replicas"] == 0, "the install must not run the operator's pod"
    return deployment


def container_of(deployment: Any) -> Any:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@contextmanager
def tls_etcd(
    cp: ControlPlane, namespace: str, ca_name: str, server_secret: str, tmp: Path
) -> Iterator[tuple[str, EtcdCredentials]]:
    """A TLS etcd with a server certificate for 127.0.0.1 from the CA Secret
    `namespace/ca_name` (made here if missing): `(its URL, root credentials)`."""
    admin = Kube(load_connection(str(cp.kubeconfig)))
    authority = EtcdAuthority.load_or_create(admin, namespace, ca_name)
    authority.ensure_server_secret(admin, namespace, server_secret, ["127.0.0.1"])
    server = secret_files(admin, namespace, server_secret, tmp / "etcd-server")
    tls = ServerTLS(server / "ca.crt", server / "tls.crt", server / "tls.key")
    with EtcdServer.start(etcd_binary(), tmp / "etcd", tls=tls) as etcd:
        yield f"https://{etcd.endpoint}", authority.root_credentials()


def run_sample(
    cp: ControlPlane,
    deployment: Any,
    etcd_url: str,
    root: EtcdCredentials,
    namespace: str,
    tmp: Path,
    reference: str,
) -> None:
    """The installed operator, as a process, runs the sample job to the end on 3 nodes."""
    operator, health = operator_process(cp, deployment, etcd_url, tmp)
    cluster = Training(cp, etcd_url, namespace, tmp, operator=operator, credentials=root)
    try:
        cluster.operator.start()
        wait_for("the operator's readiness probe", lambda: answers(health), 60.0)
        for _ in range(3):
            cluster.add_node()
        cluster.apply(trainjob("sample", sleep=0.0))
        succeeded(cluster, "sample", reference)
    finally:
        left = cluster.close()
    assert not left, f"processes outlived the test (killed now): {left}"


def operator_process(
    cp: ControlPlane, deployment: Any, etcd_url: str, tmp: Path
) -> tuple[OperatorProcess, str]:
    """The Deployment's operator as a process (not started), and its readiness URL."""
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    args = with_flag(list(container.get("args") or []), "--etcd", etcd_url)
    ports = {p["containerPort"]: p["name"] for p in container.get("ports") or []}
    args, urls = on_loopback(args, ports)
    probe = container["readinessProbe"]["httpGet"]
    assert probe["port"] in urls, f"the readiness probe's port {probe['port']} serves nothing"
    health = "/".join(urls[probe["port"]].split("/", 3)[:3]) + probe["path"]
    command = [sys.executable if c == "python" else c for c in container["command"]]
    kubeconfig = tmp / "operator.kubeconfig"
    account = pod["serviceAccountName"]
    write_service_account_kubeconfig(cp, deployment["metadata"]["namespace"], account, kubeconfig)
    argv = [*command, *args, "--kubeconfig", str(kubeconfig)]
    env = {**os.environ, **pod_env(container, deployment["metadata"]["name"])}
    return OperatorProcess(argv, tmp / "operator.log", env=env), health


def flag(args: list[str], name: str) -> str:
    """The value after `name` in `args`; the test fails if the install has no such flag."""
    assert name in args, f"the Deployment's args {args} lack {name}"
    return args[args.index(name) + 1]


def with_flag(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(name) + 1] = value
    return out


def on_loopback(args: list[str], ports: dict[int, str]) -> tuple[list[str], dict[str, str]]:
    """`args` with each `http://0.0.0.0:PORT/...` value of a declared container port moved
    to a free loopback port; also port name -> the new URL."""
    out, urls = [], {}
    for arg in args:
        for number, name in ports.items():
            prefix = f"http://0.0.0.0:{number}/"
            if arg.startswith(prefix):
                arg = f"http://127.0.0.1:{free_port()}/{arg[len(prefix) :]}"
                urls[name] = arg
        out.append(arg)
    return out, urls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pod_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's env as the kubelet sets it: values, and metadata.name for fieldRefs."""
    env = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.name", f"env {item['name']}: fieldRef {path} is not handled"
            env[item["name"]] = f"{pod_name}-e2e"
    return env


def write_service_account_kubeconfig(
    cp: ControlPlane, namespace: str, account: str, path: Path
) -> None:
    """A kubeconfig acting as `namespace/account`, from a token the API server issues."""
    token = cp.kubectl(
        "-n", namespace, "create", "token", account, "--duration=1h", check=True
    ).stdout.strip()
    admin = json.loads(cp.kubeconfig.read_text())
    config = {
        **admin,
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [
            {
                "name": "install",
                "context": {"cluster": admin["clusters"][0]["name"], "user": account},
            }
        ],
        "current-context": "install",
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)


def secret_files(kube: Kube, namespace: str, name: str, folder: Path) -> Path:
    data = kube.get_secret(namespace, name)
    assert data is not None, f"no Secret {namespace}/{name}"
    return EtcdCredentials(data["ca.crt"], data["tls.crt"], data["tls.key"]).write(folder)


def etcd_binary() -> str:
    try:
        return find_etcd(os.environ)
    except ConfigError:
        return str(build_binaries() / "etcd")


def answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2.0) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False
