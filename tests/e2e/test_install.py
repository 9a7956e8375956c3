"""Installing keepstep as a cluster admin would, on the real control plane: `kubectl apply -k
manifests/` with the real kubectl, then the operator that install describes runs the sample
TrainJob to the end with the fault-free parameters.

What a process-backed node cannot give a pod is supplied around the install, never by
changing it. The nodes have no images, no Service network and no cluster DNS, so the
operator's Deployment and the etcd StatefulSet run at 0 replicas (the overlay in install/
changes nothing else; the unchanged base is applied too, as a server-side dry run). The
operator then runs as a process of the test with the Deployment's own command, args and
env, exactly as applied, except:
- it acts with a token of the install's ServiceAccount (TokenRequest, `kubectl create
  token`) through a kubeconfig, so the RBAC the install grants is all it has;
- `--etcd` names a TLS etcd started here with the server certificate of the install's CA
  (made first in keepstep-system, as cert-manager would, and valid for 127.0.0.1);
- an `http://0.0.0.0:PORT/...` address flag (health, metrics) listens on a free loopback
  port instead of the pod's port; the readiness probe's path is asked there.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
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
    deployment = json.loads(
        cp.kubectl("-n", SYSTEM, "get", "deployment", OPERATOR, "-o", "json", check=True).stdout
    )
    with installed_operator(cp, deployment, SYSTEM, tmp_path) as (operator, creds, etcd, health):
        cluster = Training(cp, etcd, namespace, tmp_path, operator=operator, credentials=creds)
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


@contextmanager
def installed_operator(
    cp: ControlPlane, deployment: Any, namespace: str, tmp: Path
) -> Iterator[tuple[OperatorProcess, EtcdCredentials, str, str]]:
    """The Deployment's operator as a process (not started), with a TLS etcd from the
    install's CA: `(operator, etcd root credentials, etcd URL, readiness URL)`."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = list(container.get("args") or [])
    admin = Kube(load_connection(str(cp.kubeconfig)))
    ca_ns, ca_name = flag(args, "--etcd-ca-secret").split("/")
    authority = EtcdAuthority.load_or_create(admin, ca_ns, ca_name)
    server_secret = flag(args, "--etcd-server-secret")
    authority.ensure_server_secret(admin, ca_ns, server_secret, ["127.0.0.1"])
    server = secret_files(admin, ca_ns, server_secret, tmp / "etcd-server")
    tls = ServerTLS(server / "ca.crt", server / "tls.crt", server / "tls.key")
    with EtcdServer.start(etcd_binary(), tmp / "etcd", tls=tls) as etcd:
        etcd_url = f"https://{etcd.endpoint}"
        args = with_flag(args, "--etcd", etcd_url)
        ports = {p["containerPort"]: p["name"] for p in container.get("ports") or []}
        args, urls = on_loopback(args, ports)
        probe = container["readinessProbe"]["httpGet"]
        assert probe["port"] in urls, f"the readiness probe's port {probe['port']} serves nothing"
        health = urls[probe["port"]].split("/", 3)
        health_url = "/".join(health[:3]) + probe["path"]
        command = [sys.executable if c == "python" else c for c in container["command"]]
        kubeconfig = tmp / "operator.kubeconfig"
        write_service_account_kubeconfig(cp, namespace, pod["serviceAccountName"], kubeconfig)
        argv = [*command, *args, "--kubeconfig", str(kubeconfig)]
        env = {**os.environ, **pod_env(container, deployment["metadata"]["name"])}
        operator = OperatorProcess(argv, tmp / "operator.log", env=env)
        yield operator, authority.root_credentials(), etcd_url, health_url


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
