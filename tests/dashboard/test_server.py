"""The dashboard server over HTTP on 127.0.0.1, the TrainJob listing, and the subcommand."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.cli import build_parser, main
from keepstep.dashboard.server import DashboardApp, DashboardServer
from keepstep.dashboard.trainjobs import FakeTrainJobs, TrainJobsError, trainjob_rows

from .test_data import FAULTS, T, finished_inputs, run_events


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def trainjob(name: str, ns: str = "ml", **status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "keepstep.dev/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"trainer": {"numNodes": 4, "numSteps": 100},
                 "elasticPolicy": {"minNodes": 2, "maxNodes": 4, "globalBatchSize": 256}},
        "status": status,
    }  # fmt: skip


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    finished = tmp_path / "run-1-finished"
    finished.mkdir()
    inputs = finished_inputs()
    (finished / "events-n0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in run_events()))
    (finished / "faults.json").write_text(json.dumps(FAULTS))
    (finished / "summary.json").write_text(json.dumps(inputs.summary))
    live = tmp_path / "run-2-live"
    live.mkdir()
    (live / "events-n0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in run_events()[:8]))
    return tmp_path


@pytest.fixture
def server(runs: Path) -> Iterator[DashboardServer]:
    busy = trainjob("b", worldSize=3, step=40, recoveries=1, lastMttrSeconds=0.4, nodes=3)
    jobs = FakeTrainJobs([busy, trainjob("a", ns="dev", phase="Running")])
    with DashboardServer(DashboardApp(runs, jobs, clock=lambda: T + 2)) as s:
        yield s


def test_api_runs(server: DashboardServer) -> None:
    code, ctype, body = get(server.url + "api/runs")
    assert (code, ctype) == (200, "application/json")
    listed = {r["run"]: r for r in json.loads(body)}
    assert listed["run-1-finished"]["status"] == "finished"
    assert listed["run-1-finished"]["recoveries"] == 1
    assert listed["run-2-live"]["status"] == "live"
    code, _, body = get(server.url + "api/runs/run-1-finished")
    view = json.loads(body)
    assert code == 200 and view["world"]["size"] == [3] * 6 + [2] * 5
    assert get(server.url + "api/runs/nope")[0] == 404
    assert get(server.url + "api/runs/..%2F..%2Fetc")[0] == 404


def test_live_run_grows_between_requests(server: DashboardServer, runs: Path) -> None:
    url = server.url + "api/runs/run-2-live"
    assert json.loads(get(url)[2])["step"] == 2
    with (runs / "run-2-live" / "events-n0.jsonl").open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in run_events()[8:14]))
    assert json.loads(get(url)[2])["step"] == 4


def test_page_and_plotly_are_served_locally(server: DashboardServer) -> None:
    code, ctype, page = get(server.url)
    assert code == 200 and ctype.startswith("text/html")
    assert b'src="/static/plotly.min.js"' in page and b'src="/static/dashboard.js"' in page
    assert b"https://" not in page  # nothing is fetched from the network
    code, ctype, js = get(server.url + "static/plotly.min.js")
    assert code == 200 and ctype.startswith("text/javascript")
    assert len(js) > 1_000_000 and b"plotly.js" in js[:2000]
    code, _, script = get(server.url + "static/dashboard.js")
    assert code == 200 and b"Plotly.react" in script
    assert get(server.url + "static/../server.py")[0] == 404


def test_trainjobs(server: DashboardServer) -> None:
    cluster = json.loads(get(server.url + "api/trainjobs")[2])
    assert cluster["enabled"] and cluster["error"] is None
    assert [(j["namespace"], j["name"]) for j in cluster["items"]] == [("dev", "a"), ("ml", "b")]
    b = cluster["items"][1]
    assert (b["nodes"], b["min_nodes"], b["global_batch"]) == (4, 2, 256)
    assert (b["world_size"], b["step"], b["recoveries"], b["mttr_s"]) == (3, 40, 1, 0.4)
    assert (b["live_nodes"], b["steps_total"]) == (3, 100)
    assert cluster["items"][0]["phase"] == "Running"


def test_trainjob_rows_read_conditions() -> None:
    (row,) = trainjob_rows([trainjob("c", conditions=[
        {"type": "Created", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "Recovering", "status": "True", "lastTransitionTime": "2026-01-01T00:05:00Z"},
        {"type": "Succeeded", "status": "False", "lastTransitionTime": "2026-01-01T00:09:00Z"},
    ])])  # fmt: skip
    assert row["phase"] == "Recovering"
    assert trainjob_rows([{"metadata": {"name": "bare"}}])[0]["phase"] is None


class _Broken:
    def list(self, timeout_s: float) -> list[dict[str, Any]]:
        raise TrainJobsError("listing trainjobs.keepstep.dev/v1alpha1: 403 Forbidden")


def test_cluster_errors_are_shown_not_raised(runs: Path) -> None:
    assert DashboardApp(runs).cluster() == {"enabled": False, "items": [], "error": None}
    assert "403 Forbidden" in DashboardApp(runs, _Broken()).cluster()["error"]


def test_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["dashboard", "--run-dir", str(tmp_path), "--port", "0"])
    assert (args.run_dir, args.port, args.kubeconfig) == (str(tmp_path), 0, None)
    assert main(["dashboard", "--run-dir", str(tmp_path / "missing")]) == 2
    assert "--run-dir" in capsys.readouterr().err
    assert main(["dashboard", "--run-dir", str(tmp_path), "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err
    bad = tmp_path / "kubeconfig"
    bad.write_text("not: [a kubeconfig")
    assert main(["dashboard", "--run-dir", str(tmp_path), "--kubeconfig", str(bad)]) == 2
    assert f"kubeconfig {bad}" in capsys.readouterr().err


def test_unreachable_api_server_is_an_error_on_the_page(tmp_path: Path) -> None:
    from keepstep.dashboard.trainjobs import KubeTrainJobs

    config = tmp_path / "kubeconfig"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1", "kind": "Config", "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )  # fmt: skip
    source = KubeTrainJobs(config)
    try:
        cluster = DashboardApp(tmp_path, source).cluster()
    finally:
        source.close()
    assert cluster["enabled"] and cluster["items"] == []
    assert cluster["error"].startswith("listing trainjobs.keepstep.dev")
