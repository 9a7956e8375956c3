"""The operator's Prometheus metrics: the --metrics flag, the endpoint that serves them
(one path, GET only, stopped on shutdown), and the counters the reconciles and the API
client move. The kopf handlers call the same `Metrics` methods with each reconcile's
`Outcome`; tests/e2e/test_operator.py scrapes a running operator."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fake_kube import FakeKube
from op_builders import ETCD, T0, job, job_object

from keepstep.agent.kv import KVError
from keepstep.agent.kv.memory import MemoryKV
from keepstep.operator.__main__ import main, parse_args
from keepstep.operator.actions import Action, CreatePod, DeleteCause, DeletePod
from keepstep.operator.agents import AgentStore
from keepstep.operator.connection import Connection
from keepstep.operator.kube import Kube, KubeError
from keepstep.operator.metrics import Metrics, MetricsServer, Result
from keepstep.operator.podspec import pod_manifest
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import DecideConfig, Endpoint

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def value(metrics: Metrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value("keepstep_operator_" + name, labels)
    assert got is not None, (name, labels)
    return got


def fetch(url: str, method: str = "GET", data: bytes | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of one request."""
    request = urllib.request.Request(url, method=method, data=data)
    try:
        with NO_PROXY.open(request, timeout=5) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers["Content-Type"], ""


@pytest.fixture
def served() -> Iterator[tuple[Metrics, str]]:
    metrics = Metrics()
    server = MetricsServer(metrics.registry, "127.0.0.1", 0, "/metrics").start()
    try:
        yield metrics, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


# ---------------------------------------------------------------- the endpoint


def test_the_endpoint_serves_the_registry_at_its_path_and_nothing_else(
    served: tuple[Metrics, str],
) -> None:
    metrics, base = served
    metrics.pod_created()
    status, content_type, body = fetch(base + "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    assert "keepstep_operator_pods_created_total 1.0" in body
    # Every series of a label set is there from the start, at zero.
    assert 'keepstep_operator_reconciles_total{result="error"} 0.0' in body
    assert 'keepstep_operator_jobs{phase="Running"} 0.0' in body
    assert 'keepstep_operator_pods_deleted_total{reason="scale_down"} 0.0' in body
    assert "keepstep_operator_reconcile_duration_seconds_bucket" in body
    # Only the operator's own registry: nothing of the process-global one.
    assert "python_gc" not in body and "process_cpu" not in body
    assert fetch(base + "/metrics?debug=1")[0] == 200  # a query does not change the path
    for path in ("/", "/metrics/", "/healthz", "/favicon.ico"):
        assert fetch(base + path)[0] == 404, path
    for method in ("POST", "PUT", "DELETE", "HEAD"):
        assert fetch(base + "/metrics", method, b"x" * 1000)[0] == 404, method


def test_a_scraper_asking_for_openmetrics_gets_it(served: tuple[Metrics, str]) -> None:
    _, base = served
    request = urllib.request.Request(
        base + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    with NO_PROXY.open(request, timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        assert reply.read().decode().endswith("# EOF\n")


def test_a_request_that_promises_a_huge_body_is_answered_unread() -> None:
    server = MetricsServer(Metrics().registry, "127.0.0.1", 0, "/metrics", timeout=2)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
            client.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
            assert client.recv(100).startswith(b"HTTP/1.0 404")
    finally:
        server.stop()


def test_a_stopped_endpoint_closes_its_port() -> None:
    server = MetricsServer(Metrics().registry, "127.0.0.1", 0, "/metrics").start()
    port = server.port
    server.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_a_stalled_client_does_not_hold_the_endpoint() -> None:
    """One request at a time: a client that sends half a request is dropped after the
    request timeout, and the next scrape is answered."""
    server = MetricsServer(Metrics().registry, "127.0.0.1", 0, "/metrics", timeout=0.2)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as stalled:
            stalled.sendall(b"GET /metr")  # and nothing more
            assert fetch(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
    finally:
        server.stop()


# ---------------------------------------------------------------- what is counted


def reconciler(kube: FakeKube, kv: Any) -> Reconciler:
    return Reconciler(kube, AgentStore(kv, 0.5), DecideConfig(ETCD), clock=lambda: T0)


def test_reconciles_count_their_result_duration_and_the_phase_they_leave() -> None:
    metrics, kube = Metrics(), FakeKube()
    kube.jobs["demo"] = job_object(nodes=2)
    loop = reconciler(kube, MemoryKV())
    key = ("ns", "demo")
    metrics.reconciled(key, loop.reconcile("ns", "demo"), 0.02)  # creates the pods
    metrics.reconciled(key, loop.reconcile("ns", "demo"), 0.01)  # nothing to do
    assert value(metrics, "reconciles_total", result="changed") == 1
    assert value(metrics, "reconciles_total", result="unchanged") == 1
    assert value(metrics, "reconcile_duration_seconds_count") == 2
    assert value(metrics, "reconcile_duration_seconds_sum") == pytest.approx(0.03)
    assert value(metrics, "jobs", phase="Pending") == 1
    assert value(metrics, "jobs", phase="Running") == 0
    metrics.failed(Result.ERROR, 0.5)
    metrics.failed(Result.EXCEPTION, 0.1)
    assert value(metrics, "reconciles_total", result="error") == 1
    assert value(metrics, "reconciles_total", result="exception") == 1
    del kube.jobs["demo"]  # deleted: no longer counted
    metrics.reconciled(key, loop.reconcile("ns", "demo"), 0.01)
    assert value(metrics, "jobs", phase="Pending") == 0


def test_jobs_are_counted_by_phase_and_by_each_true_condition() -> None:
    metrics = Metrics()
    failed = {
        "phase": "Failed",
        "conditions": [
            {"type": "Running", "status": "False"},
            {"type": "Failed", "status": "True", "reason": "CrashLoop"},
            {"type": "CrashLoop", "status": "True"},
        ],
    }
    metrics.job_status(("a", "one"), failed)
    metrics.job_status(("b", "two"), {"phase": "Running", "conditions": []})
    metrics.job_status(("b", "three"), {"phase": "Running"})
    assert value(metrics, "jobs", phase="Failed") == 1
    assert value(metrics, "jobs", phase="Running") == 2
    assert value(metrics, "jobs_with_condition", condition="CrashLoop") == 1
    assert (
        metrics.registry.get_sample_value(
            "keepstep_operator_jobs_with_condition", {"condition": "Running"}
        )
        is None
    )  # False conditions are not counted
    metrics.job_status(("b", "two"), {})  # being deleted: no phase, counted as before
    assert value(metrics, "jobs", phase="Running") == 2
    metrics.forget(("a", "one"))
    assert value(metrics, "jobs", phase="Failed") == 0
    assert value(metrics, "jobs_with_condition", condition="CrashLoop") == 0  # not gone: 0


class ReadOnlyKV(MemoryKV):
    """etcd refuses writes: the prefix claim fails."""

    def put(self, key: str, value: bytes, timeout: float, lease: Any = None) -> int:
        raise KVError("etcd refused the write")


class UnreachableKV(ReadOnlyKV):
    """etcd unreachable: the agents' records cannot be read either."""

    def get_prefix(self, prefix: str, timeout: float) -> Any:
        raise KVError("etcd unreachable")


def test_a_reconcile_without_etcd_counts_its_etcd_errors() -> None:
    metrics = Metrics()
    for kv in (ReadOnlyKV(), UnreachableKV()):
        kube = FakeKube()
        kube.jobs["demo"] = job_object(nodes=1)
        outcome = reconciler(kube, kv).reconcile("ns", "demo")
        # The claim, or the read (without the agents' records there is nothing to claim).
        assert outcome.etcd_errors == 1
        assert kube.pods  # pods are created without etcd all the same
        metrics.reconciled(("ns", "demo"), outcome, 0.01)
    assert value(metrics, "etcd_errors_total") == 2


class ApiStub:
    """An API server on loopback that answers each (method, path) with a set status."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], tuple[int, dict[str, Any]]] = {}
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code, body = stub.answers.get((self.command, self.path), (200, {}))
                data = json.dumps(body or {"metadata": {"resourceVersion": "1"}}).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        serve = self.server.serve_forever
        threading.Thread(target=serve, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def api() -> Iterator[ApiStub]:
    stub = ApiStub()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()


def test_the_api_client_counts_requests_errors_and_pods(api: ApiStub) -> None:
    metrics = Metrics()
    kube = Kube(Connection(api.url), timeout=5.0, metrics=metrics)
    j = job()
    pods, pod = "/api/v1/namespaces/ns/pods", "/api/v1/namespaces/ns/pods/demo-node-{}"
    actions: list[Action] = [
        CreatePod(0, pod_manifest(j, 0, ETCD)),
        DeletePod("demo-node-1", "scale down to 1", DeleteCause.SCALE_DOWN),
        DeletePod("demo-node-2", "pod Failed", DeleteCause.LOST, grace_seconds=0),
    ]
    api.answers[("DELETE", pod.format(2))] = (404, {"kind": "Status"})  # already gone
    kube.apply(j.ref, actions)
    assert value(metrics, "pods_created_total") == 1
    assert value(metrics, "pods_deleted_total", reason="scale_down") == 1
    assert value(metrics, "pods_deleted_total", reason="lost") == 0  # it was gone
    assert value(metrics, "api_requests_total", kind="delete_pod") == 2
    # An existing pod is not created again; a refused one is counted by its reason.
    api.answers[("POST", pods)] = (409, {"kind": "Status", "reason": "AlreadyExists"})
    kube.apply(j.ref, actions[:1])
    assert value(metrics, "pods_created_total") == 1
    quota = {"kind": "Status", "reason": "Forbidden", "message": "exceeded quota"}
    api.answers[("POST", pods)] = (403, quota)
    assert kube.apply(j.ref, actions[:1]).refused
    assert value(metrics, "pod_creations_refused_total", reason="Forbidden") == 1
    assert value(metrics, "api_errors_total", kind="create_pod", code="403") == 1
    api.answers[("GET", "/apis/keepstep.dev/v1alpha1/namespaces/ns/trainjobs/demo")] = (500, {})
    with pytest.raises(KubeError):
        kube.get_job("ns", "demo")
    assert value(metrics, "api_errors_total", kind="get_job", code="500") == 1
    assert value(metrics, "api_requests_total", kind="create_pod") == 3


def test_an_unreachable_api_server_is_an_error_without_a_status() -> None:
    metrics = Metrics()
    with pytest.raises(KubeError):
        Kube(Connection("http://127.0.0.1:9"), timeout=1.0, metrics=metrics).get_job("ns", "d")
    assert value(metrics, "api_errors_total", kind="get_job", code="none") == 1


# ---------------------------------------------------------------- the flag


def test_the_metrics_flag_names_host_port_and_path() -> None:
    settings, _ = parse_args(["--etcd", "http://e:2379", "--metrics", "http://0.0.0.0:8081/m"])
    assert settings.metrics_endpoint == Endpoint("0.0.0.0", 8081, "/m")
    assert parse_args(["--etcd", "http://e:2379"])[0].metrics_endpoint is None
    v6, _ = parse_args(["--etcd", "http://e", "--metrics", "http://[::]:9000/metrics"])
    assert v6.metrics_endpoint == Endpoint("::", 9000, "/metrics")


@pytest.mark.parametrize(
    "url",
    [
        "https://0.0.0.0:8081/metrics",  # not http
        "0.0.0.0:8081/metrics",
        "http://0.0.0.0/metrics",  # no port
        "http://0.0.0.0:0/metrics",
        "http://0.0.0.0:70000/metrics",
        "http://0.0.0.0:port/metrics",
        "http://0.0.0.0:8081",  # no path
        "http://:8081/metrics",  # no host
        "http://0.0.0.0:8081/metrics?x=1",
        "http://user@0.0.0.0:8081/metrics",
    ],
)
def test_a_bad_metrics_url_is_a_one_line_usage_error(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--etcd", "http://e:2379", "--metrics", url])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(
        f"metrics={url!r} must be an http URL with a host, a port 1-65535 and a path "
        "(no query, no user), such as http://0.0.0.0:8081/metrics"
    )


def test_metrics_and_health_cannot_share_a_port(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--health", "http://0.0.0.0:8080/healthz", "--metrics", "http://0.0.0.0:8080/m"]
    with pytest.raises(SystemExit):
        parse_args(["--etcd", "http://e:2379", *flags])
    assert "must listen on different ports" in capsys.readouterr().err


def test_a_taken_metrics_port_ends_the_operator_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        url = f"http://127.0.0.1:{taken.getsockname()[1]}/metrics"
        argv = ["--etcd", "http://127.0.0.1:9", "--kubeconfig", str(kubeconfig), "--metrics", url]
        assert main(argv) == 1
    assert f"keepstep.operator: --metrics {url}: " in capsys.readouterr().err
