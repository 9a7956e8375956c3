"""The Kubernetes API client's contract, against a stub HTTP server on loopback: what it
sends, that repeats are harmless (409 on create, 404 on delete), that failures become
KubeError after every action was tried, and that calls are counted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from op_builders import ETCD, job

from keepstep.operator.actions import (
    Action,
    CreatePod,
    DeleteCause,
    DeletePod,
    EnsureNetworkPolicy,
    EnsureService,
    Event,
    EventType,
    PatchStatus,
    Refusal,
)
from keepstep.operator.connection import Connection
from keepstep.operator.kube import Kube, KubeError, Tally
from keepstep.operator.podspec import network_policy_manifest, pod_manifest, service_manifest


class Stub:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.answers: dict[tuple[str, str], int] = {}  # (method, path) -> status
        self.bodies: dict[tuple[str, str], Any] = {}  # (method, path) -> error body
        self.lock = threading.Lock()


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    state = Stub()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            path = self.path.split("?")[0]
            with state.lock:
                state.requests.append((self.command, self.path, dict(self.headers), body))
                code = state.answers.get((self.command, path), 200)
                error = state.bodies.get((self.command, path), {"message": "no"})
            answer = {"metadata": {"resourceVersion": "42"}, "items": [{"x": 1}]}
            data = json.dumps(answer if code < 300 else error).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_reads_are_counted_and_send_the_token(stub: tuple[Stub, str]) -> None:
    state, url = stub
    kube = Kube(Connection(url, token="tkn"), timeout=5.0)
    tally = Tally()
    assert kube.get_job("ns", "demo", tally) is not None
    assert kube.list_pods("ns", "demo", tally) == [{"x": 1}]
    state.answers[("GET", "/api/v1/namespaces/ns/services/demo")] = 404
    assert kube.service_exists("ns", "demo", tally) is False
    assert (tally.reads, tally.writes) == (3, 0)
    method, path, headers, _ = state.requests[1]
    assert method == "GET" and "labelSelector=keepstep.dev%2Fjob%3Ddemo" in path
    assert headers["Authorization"] == "Bearer tkn"


def test_the_network_policy_is_read_and_created_in_the_networking_api(
    stub: tuple[Stub, str],
) -> None:
    state, url = stub
    j = job()
    kube = Kube(Connection(url), timeout=5.0)
    path = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"
    state.answers[("GET", f"{path}/demo")] = 404
    tally = Tally()
    assert kube.network_policy_exists("ns", "demo", tally) is False
    state.answers[("POST", path)] = 409  # created by an earlier try: harmless
    kube.apply(j.ref, [EnsureNetworkPolicy(network_policy_manifest(j))], tally)
    assert (tally.reads, tally.writes) == (1, 1)
    assert tally.calls["create_network_policy"] == 1
    method, sent_to, _, body = state.requests[-1]
    assert (method, sent_to) == ("POST", path)
    assert body == network_policy_manifest(j)


def test_apply_is_idempotent_and_returns_the_new_resource_version(stub: tuple[Stub, str]) -> None:
    state, url = stub
    j = job()
    state.answers[("POST", "/api/v1/namespaces/ns/pods")] = 409  # created by an earlier try
    state.answers[("DELETE", "/api/v1/namespaces/ns/pods/demo-node-9")] = 404  # already gone
    actions: list[Action] = [
        EnsureService(service_manifest(j)),
        *(CreatePod(i, pod_manifest(j, i, ETCD)) for i in range(3)),
        DeletePod("demo-node-9", "lost", DeleteCause.LOST, grace_seconds=0),
        Event(EventType.NORMAL, "CreatedPods", "3"),
        PatchStatus({"phase": "Pending", "belowMinNodesSince": None}),
    ]
    tally = Tally()
    applied = Kube(Connection(url), parallelism=3).apply(j.ref, actions, tally)
    assert applied.version == "42" and applied.refused == ()
    assert tally.writes == 7 and tally.calls["create_pod"] == 3
    by_kind = {(m, p.split("?")[0]): b for m, p, _, b in state.requests}
    assert by_kind[("DELETE", "/api/v1/namespaces/ns/pods/demo-node-9")]["gracePeriodSeconds"] == 0
    patch = by_kind[("PATCH", "/apis/keepstep.dev/v1alpha1/namespaces/ns/trainjobs/demo/status")]
    assert patch == {"status": {"phase": "Pending", "belowMinNodesSince": None}}
    patch_headers = next(h for m, _, h, _ in state.requests if m == "PATCH")
    assert patch_headers["Content-Type"] == "application/merge-patch+json"
    event = by_kind[("POST", "/api/v1/namespaces/ns/events")]
    assert event["involvedObject"]["uid"] == "uid-1" and event["reason"] == "CreatedPods"


def test_failures_are_raised_after_every_action_was_tried(stub: tuple[Stub, str]) -> None:
    state, url = stub
    j = job()
    state.answers[("POST", "/api/v1/namespaces/ns/pods")] = 500
    state.answers[("POST", "/api/v1/namespaces/ns/events")] = 500  # events are best effort
    actions: list[Action] = [
        *(CreatePod(i, pod_manifest(j, i, ETCD)) for i in range(2)),
        Event(EventType.NORMAL, "CreatedPods", "2"),
        PatchStatus({"phase": "Pending"}),
    ]
    with pytest.raises(KubeError, match=r"2 actions on ns.demo failed: .*HTTP 500"):
        Kube(Connection(url)).apply(j.ref, actions)
    assert [m for m, *_ in state.requests].count("PATCH") == 1


def test_a_refused_pod_is_a_refusal_with_the_api_servers_reason(stub: tuple[Stub, str]) -> None:
    state, url = stub
    j = job()
    pods = ("POST", "/api/v1/namespaces/ns/pods")
    state.answers[pods] = 403
    message = 'pods "demo-node-0" is forbidden: exceeded quota: zero'
    state.bodies[pods] = {"kind": "Status", "reason": "Forbidden", "message": message}
    actions: list[Action] = [
        CreatePod(0, pod_manifest(j, 0, ETCD)),
        PatchStatus({"phase": "Pending"}),
    ]
    applied = Kube(Connection(url)).apply(j.ref, actions)  # refused: not an error
    assert applied.refused == (Refusal("demo-node-0", 403, "Forbidden", message),)
    assert applied.version == "42"
    # A conflict is not "exists" (a quota's update raced): it is retried, not skipped.
    state.answers[pods] = 409
    state.bodies[pods] = {"kind": "Status", "reason": "Conflict", "message": "try again"}
    with pytest.raises(KubeError, match="HTTP 409") as raised:
        Kube(Connection(url)).apply(j.ref, actions[:1])
    assert not raised.value.refused
    state.bodies[pods] = {"kind": "Status", "reason": "AlreadyExists", "message": "exists"}
    assert Kube(Connection(url)).apply(j.ref, actions[:1]).refused == ()


def test_an_unreachable_server_is_a_kube_error() -> None:
    with pytest.raises(KubeError):
        Kube(Connection("http://127.0.0.1:9"), timeout=1.0).get_job("ns", "demo")


def test_a_service_account_token_is_read_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    connection = Connection("https://k", token_path=str(path))
    assert connection.current_token() == "first"
    path.write_text("rotated")
    assert connection.current_token() == "rotated"
