"""Fixtures of the end-to-end tests: one real control plane per session, a separate etcd
for the training jobs, the TrainJob CRD, and a fresh namespace per test (the helpers the
tests share beside these fixtures are in helpers.py).

The control plane is the real kube-apiserver, kube-controller-manager, kube-scheduler and
etcd built by e2e/controlplane/build (see keepstep.e2e.controlplane); it starts once, on
first use, and is shared, so every test works in its own namespace and names any
cluster-scoped object (a Node) uniquely.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator

import pytest

from keepstep.e2e.controlplane import ControlPlane, build_binaries
from keepstep.e2e.procs import StartupError

from .helpers import apply_crd

# Below the 120 s per-test timeout, which also covers a session fixture's setup.
START_TIMEOUT = 90.0


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A started control plane; `control_plane.kubectl(...)` runs the real kubectl."""
    try:
        cp = ControlPlane.start(tmp_path_factory.mktemp("controlplane"), timeout=START_TIMEOUT)
    except StartupError as err:
        pytest.fail(f"the control plane did not start: {err}")
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def jobs_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The client URL ("http://127.0.0.1:PORT") of an etcd for the training jobs' records,
    separate from the control plane's."""
    # Imported here: the agent's modules pull in torch, which tests without jobs never need.
    from keepstep.elastic.errors import ConfigError
    from keepstep.launch.etcd_server import EtcdServer, find_etcd

    try:
        binary = find_etcd(os.environ)
    except ConfigError:
        binary = str(build_binaries() / "etcd")
    with EtcdServer.start(binary, tmp_path_factory.mktemp("jobs-etcd")) as server:
        yield f"http://{server.endpoint}"


@pytest.fixture(scope="session")
def trainjob_crd(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the TrainJob CRD applied and Established."""
    apply_crd(control_plane)
    return control_plane


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of its own for one test, ready for pods (its default ServiceAccount
    exists); deleted after the test without waiting for the deletion to finish."""
    name = namespace_name(request.node.name)
    control_plane.kubectl("create", "namespace", name, check=True)
    control_plane.wait_for_service_account(name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def namespace_name(test_name: str) -> str:
    """A DNS label from the test's name, with a random tail so reruns never collide."""
    slug = re.sub(r"[^a-z0-9]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"t-{slug or 'test'}-{secrets.token_hex(3)}"
