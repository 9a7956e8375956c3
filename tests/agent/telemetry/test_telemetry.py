"""Telemetry: event-log events become the right OTel metrics and recovery spans, and the
configured exporters (Prometheus over a real port, files, OTLP/HTTP to a loopback
receiver) deliver them; the Grafana dashboard only queries metrics that exist."""

from __future__ import annotations

import itertools
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from keepstep.agent.protocol.events import EventKind, EventLog, read_events
from keepstep.agent.protocol.recovery import recoveries
from keepstep.agent.telemetry.config import ExporterKind, TelemetryConfig, parse_headers
from keepstep.agent.telemetry.export import TelemetryError
from keepstep.agent.telemetry.otel import Telemetry, create_telemetry
from keepstep.agent.telemetry.recovery import RecoveryTracker
from keepstep.elastic.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "manifests" / "grafana" / "keepstep-dashboard.json"
T = 1_800_000_000.0  # a wall-clock origin for the synthetic events


def commit(t: float, epoch: int, step: int, world: int, **extra: Any) -> dict[str, Any]:
    members = [f"n{i}/0" for i in range(world)]
    per = 6 // world  # 6 micro-batches of 4 samples: a global batch of 24
    assignment = {m: list(range(i * per, (i + 1) * per)) for i, m in enumerate(members)}
    return {
        "t": T + t,
        "kind": "commit",
        "member": "n0/0",
        "step": step,
        "epoch": epoch,
        "world_size": world,
        "micro_batches": assignment["n0/0"],
        "samples": list(range(4 * per)),
        "step_s": 0.02,
        "assignment": assignment,
        **extra,
    }


def recovery_events() -> list[dict[str, Any]]:
    """One node's log: 4 steps at world 3, a lost peer, 2 steps at world 2."""
    ev = [commit(0.1 * s, 0, s, 3, snapshot_s=0.004) for s in range(4)]
    ev += [
        {"t": T + 1.0, "kind": "fault-detected", "cause": "collective", "node": "n0",
         "epoch": 0, "reason": "allreduce failed", "fault_t": T + 0.9},
        {"t": T + 1.2, "kind": "epoch-agreed", "epoch": 1, "members": ["n0/0", "n2/0"],
         "reason": "lost n1/0", "planned": False, "step": 4, "agree_s": 0.2},
        {"t": T + 1.3, "kind": "reconfigured", "member": "n0/0", "epoch": 1,
         "members": ["n0/0", "n2/0"], "communicator_s": 0.05, "restore_s": 0.03,
         "replan_s": 0.001, "resume_step": 3, "rolled_back_steps": 1, "received_state": False},
        {"t": T + 1.31, "kind": "reconfigured", "member": "n0/1", "epoch": 1,
         "members": ["n0/0", "n2/0"], "communicator_s": 0.04, "restore_s": 0.02,
         "replan_s": 0.002, "resume_step": 3, "rolled_back_steps": 0, "received_state": False},
        commit(1.5, 1, 3, 2, snapshot_s=0.004),
        commit(1.6, 1, 4, 2, snapshot_s=0.004),
        commit(1.7, 1, 5, 2, snapshot_s=0.004),
        {"t": T + 1.8, "kind": "worker-exited", "member": "n0/1", "pid": 7, "code": -9},
        # Died on its way out after its finish was recorded: not a failure.
        {"t": T + 1.9, "kind": "worker-exited", "member": "n0/0", "pid": 8, "code": -6,
         "finished": True},
    ]  # fmt: skip
    return ev


@pytest.fixture
def memory() -> Iterator[tuple[Telemetry, InMemoryMetricReader, InMemorySpanExporter]]:
    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    tel = Telemetry(
        node="n0", trainjob="demo", metric_readers=[reader],
        span_processors=[SimpleSpanProcessor(spans)],
    )  # fmt: skip
    yield tel, reader, spans
    tel.close()


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics:
        assert rm.resource.attributes["keepstep.node"] == "n0"
        assert rm.resource.attributes["keepstep.trainjob"] == "demo"
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def test_events_become_metrics(memory: Any) -> None:
    tel, reader, _ = memory
    for e in recovery_events():
        tel.on_event(e)
    p = points(reader)
    (step_time,) = p["keepstep.step.duration"]
    assert step_time.count == 7 and step_time.sum == pytest.approx(0.14)
    assert p["keepstep.snapshot.duration"][0].count == 7
    assert p["keepstep.world_size"][0].value == 2  # after the loss
    assert p["keepstep.step"][0].value == 5
    # Epoch 1 alone: 2 intervals of 0.1 s, 24 samples each.
    assert p["keepstep.samples.rate"][0].value == pytest.approx(240.0)
    (recoveries,) = p["keepstep.recoveries"]
    assert recoveries.value == 1
    assert dict(recoveries.attributes) == {"cause": "collective", "planned": False}
    (mttr,) = p["keepstep.recovery.duration"]
    assert mttr.count == 1 and mttr.sum == pytest.approx(0.6)  # fault_t 0.9 -> commit 1.5
    assert p["keepstep.rolled_back_steps"][0].value == 1
    assert p["keepstep.worker.failures"][0].value == 1  # the crash, not the exit after finish
    phases = {dict(q.attributes)["phase"]: q.sum for q in p["keepstep.recovery.phase.duration"]}
    assert phases == pytest.approx(
        {"detect": 0.1, "agree": 0.2, "communicator": 0.05, "restore": 0.03,
         "replan": 0.002, "first-step": 0.218},
        abs=1e-6,  # wall-clock seconds near 1.8e9 keep about 7 decimals
    )  # fmt: skip


def test_recovery_is_one_span_with_a_child_per_phase(memory: Any) -> None:
    tel, _, exporter = memory
    for e in recovery_events():
        tel.on_event(e)
    spans: list[ReadableSpan] = list(exporter.get_finished_spans())
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "keepstep.recovery"
    assert root.start_time == int((T + 0.9) * 1e9) and root.end_time == int((T + 1.5) * 1e9)
    assert root.attributes is not None
    assert root.attributes["keepstep.epoch"] == 1
    assert root.attributes["keepstep.cause"] == "collective"
    assert root.attributes["keepstep.resume_step"] == 3
    children = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time or 0)
    assert [c.name for c in children] == [
        f"keepstep.recovery.{p}"
        for p in ("detect", "agree", "communicator", "restore", "replan", "first-step")
    ]
    assert all(c.parent is not None and c.parent.span_id == root.context.span_id for c in children)
    assert all(c.context.trace_id == root.context.trace_id for c in children)
    # End to end: the phases tile the span from the fault to the first commit.
    assert children[0].start_time == root.start_time
    assert children[-1].end_time == root.end_time
    for a, b in itertools.pairwise(children):
        assert a.end_time == b.start_time


def test_planned_change_and_unowned_epochs(memory: Any) -> None:
    tel, reader, exporter = memory
    tel.on_event(commit(0.0, 0, 0, 2))
    tel.on_event(commit(0.1, 0, 1, 2))
    # Epoch 1 was agreed by another node: this one reconfigures but reports nothing.
    tel.on_event({"t": T + 0.2, "kind": "reconfigured", "member": "n0/0", "epoch": 1,
                  "members": ["n0/0"], "communicator_s": 0.01, "restore_s": 0.0,
                  "replan_s": 0.0, "resume_step": 2, "rolled_back_steps": 0,
                  "received_state": False})  # fmt: skip
    tel.on_event(commit(0.3, 1, 2, 2))
    assert exporter.get_finished_spans() == ()
    # Epoch 2 is a join this node agreed at a step boundary.
    tel.on_event({"t": T + 0.5, "kind": "epoch-agreed", "epoch": 2, "members": ["n0/0", "n1/0"],
                  "reason": "admit n1/0", "planned": True, "step": 3})  # fmt: skip
    tel.on_event(commit(0.8, 2, 3, 2))
    (root,) = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert root.attributes is not None and root.attributes["keepstep.cause"] == "join"
    assert root.start_time == int((T + 0.5) * 1e9)
    (recoveries,) = points(reader)["keepstep.recoveries"]
    assert dict(recoveries.attributes) == {"cause": "join", "planned": True}


def test_logged_metrics_are_one_gauge_by_name_from_the_first_member(memory: Any) -> None:
    tel, reader, _ = memory
    tel.on_event(commit(0.1, 0, 0, 2, metrics={"loss": 2.0, "acc": 0.25}))
    # n1/0 holds micro-batches 3-5: the same values, and it does not report them.
    other = commit(0.11, 0, 0, 2, metrics={"loss": 99.0})
    other.update(member="n1/0", micro_batches=[3, 4, 5])
    tel.on_event(other)
    tel.on_event(commit(0.2, 0, 1, 2, metrics={"loss": 1.5, "acc": 0.5}))
    got = {dict(q.attributes)["name"]: q.value for q in points(reader)["keepstep.train.metric"]}
    assert got == {"loss": 1.5, "acc": 0.5}
    # A step redone in a later epoch: its redo is the value now.
    tel.on_event(commit(0.5, 1, 1, 2, metrics={"loss": 1.25}))
    got = {dict(q.attributes)["name"]: q.value for q in points(reader)["keepstep.train.metric"]}
    assert got["loss"] == 1.25


def test_a_run_without_logged_metrics_exports_no_train_metric(memory: Any) -> None:
    tel, reader, _ = memory
    for e in recovery_events():
        tel.on_event(e)
    assert "keepstep.train.metric" not in points(reader)


def test_malformed_events_never_raise(memory: Any, caplog: pytest.LogCaptureFixture) -> None:
    tel, reader, _ = memory
    tel.on_event({"t": T, "kind": "commit", "step": "x"})
    tel.on_event({"t": T, "kind": "commit"})
    tel.on_event({"kind": "something-new", "t": T})
    tel.on_event(commit(0.1, 0, 0, 2))
    assert points(reader)["keepstep.step"][0].value == 0
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


def test_takes_what_event_log_writes(tmp_path: Path, memory: Any) -> None:
    tel, reader, _ = memory
    log = EventLog(tmp_path / "events-n0.jsonl")
    for e in recovery_events():
        fields = {k: v for k, v in e.items() if k not in ("t", "kind")}
        log.write(EventKind(e["kind"]), **fields)
    log.close()
    for e in read_events(tmp_path):
        tel.on_event(e)
    assert points(reader)["keepstep.recoveries"][0].value == 1


def test_the_tracker_reports_what_the_fold_makes_of_the_log() -> None:
    """Fed one event at a time, the tracker yields the fold's records of the node's whole log,
    each at the commit that ends it; a fault during a recovery ends both at once."""
    events = [e for e in recovery_events() if e["t"] < T + 1.5]  # up to epoch 1's start
    events += [
        {"t": T + 1.4, "kind": "fault-detected", "cause": "worker-exit", "node": "n0",
         "epoch": 1, "reason": "worker n0/1 exited"},
        {"t": T + 1.45, "kind": "epoch-agreed", "epoch": 2, "members": ["n0/0"],
         "reason": "lost n2/0", "planned": False, "step": 3},
        commit(1.6, 2, 3, 1),
        commit(1.7, 2, 4, 1),
    ]  # fmt: skip
    tracker = RecoveryTracker()
    reported = [(e["t"], r) for e in events for r in tracker.observe(e)]
    assert [r for _, r in reported] == recoveries(events)
    assert [(t, r.epoch) for t, r in reported] == [(T + 1.6, 1), (T + 1.6, 2)]


def test_config_from_env() -> None:
    assert TelemetryConfig.from_env({}).exporters == frozenset()
    assert not TelemetryConfig.from_env({}).enabled
    otlp = TelemetryConfig.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
         "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20x, team=ml"}
    )  # fmt: skip
    assert otlp.exporters == {ExporterKind.OTLP}
    assert otlp.headers == (("authorization", "Bearer x"), ("team", "ml"))
    both = TelemetryConfig.from_env(
        {"KEEPSTEP_TELEMETRY": "prometheus, file", "KEEPSTEP_TELEMETRY_PORT": "9100",
         "KEEPSTEP_TELEMETRY_PATH": "/var/run/ks", "KEEPSTEP_TELEMETRY_INTERVAL": "2.5"}
    )  # fmt: skip
    assert both.exporters == {ExporterKind.PROMETHEUS, ExporterKind.FILE}
    assert (both.port, str(both.path), both.interval_s) == (9100, "/var/run/ks", 2.5)
    assert TelemetryConfig.from_env({"KEEPSTEP_TELEMETRY": "none"}).exporters == frozenset()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KEEPSTEP_TELEMETRY": "statsd"}, "unknown exporter 'statsd'"),
        ({"KEEPSTEP_TELEMETRY": "otlp"}, "needs an endpoint"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "http:// or https://"),
        ({"KEEPSTEP_TELEMETRY_PORT": "ninety"}, "KEEPSTEP_TELEMETRY_PORT='ninety'"),
        ({"KEEPSTEP_TELEMETRY_PORT": "70000"}, "port 70000"),
        ({"KEEPSTEP_TELEMETRY_INTERVAL": "0"}, "interval 0.0"),
    ],
)
def test_config_errors_name_the_value(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        TelemetryConfig.from_env(env)


def test_header_errors() -> None:
    with pytest.raises(ConfigError, match="'novalue'"):
        parse_headers("a=1,novalue")


def scrape(tel: Telemetry) -> str:
    assert tel.prometheus_address is not None
    host, port = tel.prometheus_address
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def prometheus_telemetry() -> Telemetry:
    config = TelemetryConfig(
        exporters=frozenset({ExporterKind.PROMETHEUS}), host="127.0.0.1", port=0
    )
    return create_telemetry(config, node="n0", trainjob="demo")


def value(text: str, name: str) -> float:
    """The value of the first sample called `name` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.split("{")[0].split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1].isalpha()}


def test_prometheus_endpoint_serves_the_metrics() -> None:
    tel = prometheus_telemetry()
    try:
        for e in recovery_events():
            tel.on_event(e)
        tel.on_event(commit(1.8, 1, 6, 2, metrics={"loss": 0.5}))
        text = scrape(tel)
    finally:
        tel.close()
    assert 'keepstep_world_size{keepstep_node="n0",keepstep_trainjob="demo"' in text
    assert re.search(r'keepstep_train_metric\{.*name="loss".*\} 0\.5', text)
    assert re.search(r'keepstep_recoveries_total\{cause="collective".*\} 1\.0', text)
    assert value(text, "keepstep_recovery_duration_seconds_sum") == pytest.approx(0.6, abs=1e-6)
    assert value(text, "keepstep_step_duration_seconds_count") == 8
    assert value(text, "keepstep_samples_rate_per_second") == pytest.approx(240.0)
    assert value(text, "keepstep_world_size") == 2
    host, port = tel.prometheus_address or ("", 0)
    with pytest.raises(OSError):  # closed with the telemetry
        urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2)


def test_taken_prometheus_port_is_a_clear_error() -> None:
    first = prometheus_telemetry()
    try:
        assert first.prometheus_address is not None
        config = TelemetryConfig(
            exporters=frozenset({ExporterKind.PROMETHEUS}),
            host="127.0.0.1",
            port=first.prometheus_address[1],
        )
        with pytest.raises(TelemetryError, match=f"127.0.0.1:{config.port}"):
            create_telemetry(config, node="n1", trainjob="demo")
    finally:
        first.close()


def test_grafana_panels_query_exported_metrics() -> None:
    tel = prometheus_telemetry()
    try:
        for e in recovery_events():
            tel.on_event(e)
        exported = sample_names(scrape(tel))
    finally:
        tel.close()
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"]
    queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            names = re.findall(r"\bkeepstep_[a-z_]+", expr)
            assert any(not n.startswith("keepstep_trainjob") for n in names), expr
            queries.append(expr)
    for expr in queries:
        for name in re.findall(r"\bkeepstep_[a-z_]+", expr):
            if name in ("keepstep_trainjob", "keepstep_node"):
                continue  # labels, not metrics
            assert name in exported, f"{name} (in {expr!r}) is not exported"
    assert {"keepstep_trainjob"} <= {
        m for q in queries for m in re.findall(r"\bkeepstep_trainjob\b", q)
    }


def test_file_exporter_writes_metrics_and_spans(tmp_path: Path) -> None:
    config = TelemetryConfig(exporters=frozenset({ExporterKind.FILE}), path=tmp_path / "tel")
    tel = create_telemetry(config, node="n0/x", trainjob="demo")
    for e in recovery_events():
        tel.on_event(e)
    tel.close()
    span_lines = (tmp_path / "tel/telemetry-spans-n0-x.jsonl").read_text().splitlines()
    spans = [json.loads(line) for line in span_lines]
    assert sorted(s["name"] for s in spans)[0] == "keepstep.recovery"
    assert len(spans) == 7
    lines = (tmp_path / "tel/telemetry-metrics-n0-x.jsonl").read_text().splitlines()
    assert lines  # at least the export at shutdown
    names = {
        m["name"]
        for line in lines
        for rm in json.loads(line)["resource_metrics"]
        for sm in rm["scope_metrics"]
        for m in sm["metrics"]
    }
    assert {"keepstep.recoveries", "keepstep.recovery.duration", "keepstep.world_size"} <= names


class _Receiver(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, int]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, self.headers.get("team", ""), len(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_otlp_exporter_posts_to_the_endpoint() -> None:
    seen: list[tuple[str, str, int]] = []
    handler = type("Receiver", (_Receiver,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = TelemetryConfig(
            exporters=frozenset({ExporterKind.OTLP}),
            endpoint=f"http://127.0.0.1:{server.server_address[1]}/",
            headers=(("team", "ml"),),
        )
        tel = create_telemetry(config, node="n0", trainjob="demo")
        for e in recovery_events():
            tel.on_event(e)
        tel.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    paths = {(path, team) for path, team, size in seen if size > 0}
    assert paths == {("/v1/metrics", "ml"), ("/v1/traces", "ml")}


def test_unwritable_telemetry_folder_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    config = TelemetryConfig(exporters=frozenset({ExporterKind.FILE}), path=blocker / "tel")
    with pytest.raises(TelemetryError, match="telemetry files in"):
        create_telemetry(config, node="n0", trainjob="demo")
