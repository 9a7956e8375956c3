"""The one module that talks to telemetry backends: OTLP/HTTP, a Prometheus scrape
endpoint, and JSON-lines files.

`build_exporters(config, node=...)` turns a `TelemetryConfig` into metric readers, span
processors and the stop functions `Telemetry.close` calls; nothing here is global (the
Prometheus endpoint has its own registry), so several agents can share a process.

    otlp        metrics every interval to {endpoint}/v1/metrics, spans in batches to
                {endpoint}/v1/traces
    prometheus  http://{host}:{port}/metrics, collected at scrape time; spans are not
                exported by this kind (pair it with otlp or file for traces)
    file        {path}/telemetry-metrics-{node}.jsonl every interval and
                {path}/telemetry-spans-{node}.jsonl as each recovery ends, one JSON
                object per line
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)

from keepstep.agent.telemetry.config import ExporterKind, TelemetryConfig
from keepstep.errors import KeepstepError

# Resource attributes copied onto every Prometheus series as labels (the others go to
# target_info), so a dashboard can select one job and tell nodes apart.
PROMETHEUS_LABELS = frozenset({"keepstep.trainjob", "keepstep.node"})
EXPORT_TIMEOUT_S = 5.0


class TelemetryError(KeepstepError):
    """An exporter could not be set up (e.g. the Prometheus port is taken)."""


@dataclass
class Exporters:
    metric_readers: list[MetricReader] = field(default_factory=list)
    span_processors: list[SpanProcessor] = field(default_factory=list)
    on_close: list[Callable[[], None]] = field(default_factory=list)
    prometheus_address: tuple[str, int] | None = None


def build_exporters(config: TelemetryConfig, *, node: str) -> Exporters:
    out = Exporters()
    interval_ms = config.interval_s * 1000
    # Those that can fail on I/O (a taken port, an unwritable folder) go first, before
    # any exporter thread is started.
    if ExporterKind.PROMETHEUS in config.exporters:
        _add_prometheus(out, config)
    if ExporterKind.FILE in config.exporters:
        try:
            _add_file(out, config, node, interval_ms)
        except OSError as error:
            for stop in out.on_close:
                stop()
            raise TelemetryError(f"telemetry files in {config.path}: {error}") from None
    if ExporterKind.OTLP in config.exporters:
        _add_otlp(out, config, interval_ms)
    return out


def _add_otlp(out: Exporters, config: TelemetryConfig, interval_ms: float) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    assert config.endpoint is not None  # TelemetryConfig checks this
    base = config.endpoint.rstrip("/")
    headers = dict(config.headers)
    metrics = OTLPMetricExporter(
        endpoint=f"{base}/v1/metrics", headers=headers, timeout=EXPORT_TIMEOUT_S
    )
    spans = OTLPSpanExporter(
        endpoint=f"{base}/v1/traces", headers=headers, timeout=EXPORT_TIMEOUT_S
    )
    out.metric_readers.append(
        PeriodicExportingMetricReader(
            metrics,
            export_interval_millis=interval_ms,
            export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
        )
    )
    out.span_processors.append(BatchSpanProcessor(spans))


def _add_prometheus(out: Exporters, config: TelemetryConfig) -> None:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=True)
    out.metric_readers.append(
        PrometheusMetricReader(
            registry=registry, resource_attribute_filter=PROMETHEUS_LABELS.__contains__
        )
    )
    try:
        server, thread = start_http_server(config.port, addr=config.host, registry=registry)
    except OSError as error:
        raise TelemetryError(
            f"Prometheus endpoint {config.host}:{config.port}: {error.strerror or error} "
            "(KEEPSTEP_TELEMETRY_PORT: one free port per agent, or 0 for any)"
        ) from None
    out.prometheus_address = (config.host, int(server.server_port))

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(EXPORT_TIMEOUT_S)

    out.on_close.append(stop)


def _add_file(out: Exporters, config: TelemetryConfig, node: str, interval_ms: float) -> None:
    config.path.mkdir(parents=True, exist_ok=True)
    safe = node.replace("/", "-")
    metrics_file = open(config.path / f"telemetry-metrics-{safe}.jsonl", "a", buffering=1)
    try:
        spans_file = open(config.path / f"telemetry-spans-{safe}.jsonl", "a", buffering=1)
    except OSError:
        metrics_file.close()
        raise
    out.metric_readers.append(
        PeriodicExportingMetricReader(
            ConsoleMetricExporter(out=metrics_file, formatter=_metrics_line),
            export_interval_millis=interval_ms,
            export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
        )
    )
    out.span_processors.append(
        SimpleSpanProcessor(ConsoleSpanExporter(out=spans_file, formatter=_span_line))
    )
    out.on_close.append(lambda: _close_all(metrics_file, spans_file))


def _metrics_line(data: MetricsData) -> str:
    return str(data.to_json(indent=None)) + "\n"


def _span_line(span: ReadableSpan) -> str:
    return str(span.to_json(indent=None)) + "\n"


def _close_all(*files: IO[str]) -> None:
    for f in files:
        f.close()
