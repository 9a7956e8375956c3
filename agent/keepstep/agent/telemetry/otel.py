"""OpenTelemetry from the node agent: event-log events become metrics and recovery traces.

The agent's `EventLog` hands every event it writes to `Telemetry.on_event` (the same
dict that goes into `events-<node>.jsonl`). Commits feed step time, snapshot time, world
size, the last step, samples/s and what `step.log` recorded; worker exits count failures;
each recovery this node agreed (`telemetry.recovery`, over the one fold
`protocol.recovery`) becomes one span with a child span per phase, the MTTR and phase
histograms and the recovery counter.
`create_telemetry` wires the exporters a `TelemetryConfig` names (`telemetry.export`);
tests pass in-memory readers.

Metric names (OTel; the Prometheus name in brackets):
    keepstep.step.duration          histogram s   [keepstep_step_duration_seconds]
    keepstep.snapshot.duration      histogram s   [keepstep_snapshot_duration_seconds]
    keepstep.samples.rate           gauge 1/s     [keepstep_samples_rate_per_second]
    keepstep.world_size             gauge         [keepstep_world_size]
    keepstep.step                   gauge         [keepstep_step]
    keepstep.train.metric           gauge, name=  [keepstep_train_metric]
    keepstep.recoveries             counter       [keepstep_recoveries_total]
    keepstep.recovery.duration      histogram s   [keepstep_recovery_duration_seconds]
    keepstep.recovery.phase.duration histogram s  [keepstep_recovery_phase_duration_seconds]
    keepstep.rolled_back_steps      counter       [keepstep_rolled_back_steps_total]
    keepstep.worker.failures        counter       [keepstep_worker_failures_total]
Every point carries the resource attributes keepstep.trainjob and keepstep.node.
`keepstep.train.metric` is the step's value of each name `step.log` took (e.g.
name="loss"), set only by the node that hosts the epoch's first member: each step's values
once in the job, not once per node (after a membership change another node may lead).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from keepstep.agent.protocol.events import EventKind, kind_of
from keepstep.agent.protocol.recovery import RecoveryRecord, phases
from keepstep.agent.telemetry.config import TelemetryConfig
from keepstep.agent.telemetry.recovery import RecoveryTracker

log = logging.getLogger(__name__)

SCOPE = "keepstep.agent"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Distinct steps the samples/s gauge averages over: smooths one slow step, and still
# follows a change of world size within a few steps.
RATE_WINDOW = 8


class Kind(enum.Enum):
    HISTOGRAM = "histogram"
    GAUGE = "gauge"
    COUNTER = "counter"


class Metric(enum.Enum):
    """Every instrument: its kind, OTel name, unit, description and histogram buckets."""

    STEP_TIME = (
        Kind.HISTOGRAM,
        "keepstep.step.duration",
        "s",
        "compute time of one committed step on one worker",
        STEP_BUCKETS,
    )
    SNAPSHOT_TIME = (
        Kind.HISTOGRAM,
        "keepstep.snapshot.duration",
        "s",
        "time to copy a committed step into the node's snapshot",
        STEP_BUCKETS,
    )
    SAMPLES_RATE = (
        Kind.GAUGE,
        "keepstep.samples.rate",
        "1/s",
        "job samples per second over the last steps",
        (),
    )
    WORLD_SIZE = (Kind.GAUGE, "keepstep.world_size", "", "members of the epoch", ())
    STEP = (Kind.GAUGE, "keepstep.step", "", "last committed step", ())
    TRAIN_METRIC = (
        Kind.GAUGE,
        "keepstep.train.metric",
        "",
        "the last committed step's value of a step.log name, its mean over the step",
        (),
    )
    RECOVERIES = (
        Kind.COUNTER,
        "keepstep.recoveries",
        "",
        "membership changes this node agreed",
        (),
    )
    MTTR = (
        Kind.HISTOGRAM,
        "keepstep.recovery.duration",
        "s",
        "time from a fault (or planned change) to the first commit after it",
        RECOVERY_BUCKETS,
    )
    PHASE_TIME = (
        Kind.HISTOGRAM,
        "keepstep.recovery.phase.duration",
        "s",
        "duration of each recovery phase",
        RECOVERY_BUCKETS,
    )
    ROLLED_BACK = (
        Kind.COUNTER,
        "keepstep.rolled_back_steps",
        "",
        "committed steps thrown away by recoveries",
        (),
    )
    WORKER_FAILURES = (
        Kind.COUNTER,
        "keepstep.worker.failures",
        "",
        "workers that crashed (a nonzero exit before their finish was recorded)",
        (),
    )

    def __init__(
        self, kind: Kind, otel_name: str, unit: str, description: str, buckets: tuple[float, ...]
    ) -> None:
        self.kind = kind
        self.otel_name = otel_name
        self.unit = unit
        self.description = description
        self.buckets = buckets


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Telemetry:
    """Maps one node's events to OTel; `close` flushes and stops every exporter."""

    def __init__(
        self,
        *,
        node: str,
        trainjob: str,
        metric_readers: Sequence[MetricReader] = (),
        span_processors: Sequence[SpanProcessor] = (),
        on_close: Sequence[Callable[[], None]] = (),
        prometheus_address: tuple[str, int] | None = None,
    ) -> None:
        self.prometheus_address = prometheus_address  # (host, port) being served, if any
        # Built directly (not Resource.create) so OTEL_* variables are not read here.
        resource = Resource(
            {
                "service.name": "keepstep-agent",
                "service.instance.id": node,
                "keepstep.trainjob": trainjob,
                "keepstep.node": node,
            }
        )
        self._meters = MeterProvider(resource=resource, metric_readers=list(metric_readers))
        self._tracers = TracerProvider(resource=resource)
        for processor in span_processors:
            self._tracers.add_span_processor(processor)
        self._on_close = list(on_close)
        self._tracer = self._tracers.get_tracer(SCOPE)
        meter = self._meters.get_meter(SCOPE)
        self._histograms = {
            m: meter.create_histogram(
                m.otel_name, m.unit, m.description, explicit_bucket_boundaries_advisory=m.buckets
            )
            for m in Metric
            if m.kind is Kind.HISTOGRAM
        }
        self._gauges = {
            m: meter.create_gauge(m.otel_name, m.unit, m.description)
            for m in Metric
            if m.kind is Kind.GAUGE
        }
        self._counters = {
            m: meter.create_counter(m.otel_name, m.unit, m.description)
            for m in Metric
            if m.kind is Kind.COUNTER
        }
        self._lock = threading.Lock()
        self._tracker = RecoveryTracker()
        self._commits: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)
        self._last: tuple[int, int] | None = None  # (epoch, step) of the newest commit
        self._warned = False
        self._closed = False

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Take one event exactly as `EventLog.write` wrote it; never raises."""
        try:
            with self._lock:
                if self._closed:
                    return
                self._dispatch(event)
        except (KeyError, TypeError, ValueError) as error:
            # Telemetry must not take the agent down; one warning names the bad event.
            if not self._warned:
                self._warned = True
                log.warning("telemetry skipped a malformed %r event: %r", event.get("kind"), error)

    def _dispatch(self, event: Mapping[str, Any]) -> None:
        kind = kind_of(event)
        if kind is EventKind.COMMIT:
            self._on_commit(event)
        elif (
            kind is EventKind.WORKER_EXITED
            and int(event["code"]) != 0
            and not event.get("finished")
        ):
            self._counters[Metric.WORKER_FAILURES].add(1)
        for recovery in self._tracker.observe(event):
            self._on_recovery(recovery)

    def _on_commit(self, event: Mapping[str, Any]) -> None:
        self._histograms[Metric.STEP_TIME].record(float(event["step_s"]))
        if "snapshot_s" in event:
            self._histograms[Metric.SNAPSHOT_TIME].record(float(event["snapshot_s"]))
        if 0 in event.get("micro_batches", ()):
            # The epoch's first member computes micro-batch 0: one commit per step in the
            # job, and its values are every member's (reduced across them).
            for name, value in (event.get("metrics") or {}).items():
                self._gauges[Metric.TRAIN_METRIC].set(float(value), {"name": str(name)})
        epoch, step = int(event["epoch"]), int(event["step"])
        key = (epoch, step)
        if self._last is not None and key <= self._last:
            return  # another member of this node committed the same step
        if self._last is not None and epoch != self._last[0]:
            self._commits.clear()  # throughput of the new membership only
        self._last = key
        self._gauges[Metric.WORLD_SIZE].set(int(event["world_size"]))
        self._gauges[Metric.STEP].set(step)
        self._commits.append((float(event["t"]), _global_batch(event)))
        if len(self._commits) >= 2:
            span = self._commits[-1][0] - self._commits[0][0]
            samples = sum(n for _, n in list(self._commits)[1:])
            if span > 0:
                self._gauges[Metric.SAMPLES_RATE].set(samples / span)

    def _on_recovery(self, r: RecoveryRecord) -> None:
        tiled = phases(r)
        start, end = tiled[0].start, tiled[-1].end
        mttr = end - start  # what the span covers (clamped, as its phases are)
        attrs: dict[str, str | bool] = {"cause": r.cause, "planned": r.planned}
        self._counters[Metric.RECOVERIES].add(1, attrs)
        self._histograms[Metric.MTTR].record(mttr, attrs)
        self._counters[Metric.ROLLED_BACK].add(r.rolled_back_steps, attrs)
        span = self._tracer.start_span(
            "keepstep.recovery",
            start_time=_ns(start),
            attributes={
                "keepstep.epoch": r.epoch,
                "keepstep.cause": r.cause,
                "keepstep.planned": r.planned,
                "keepstep.members": list(r.members),
                "keepstep.reason": r.reason,
                "keepstep.resume_step": -1 if r.step is None else r.step,
                "keepstep.rolled_back_steps": r.rolled_back_steps,
                "keepstep.mttr_s": mttr,
            },
        )
        parent = trace.set_span_in_context(span)
        for phase in tiled:
            self._histograms[Metric.PHASE_TIME].record(phase.seconds, {"phase": phase.name})
            child = self._tracer.start_span(
                f"keepstep.recovery.{phase.name}",
                context=parent,
                start_time=_ns(phase.start),
                attributes={"keepstep.phase": phase.name},
            )
            child.end(end_time=_ns(phase.end))
        span.end(end_time=_ns(end))

    def flush(self, timeout_s: float = 5.0) -> None:
        self._tracers.force_flush(int(timeout_s * 1000))
        self._meters.force_flush(timeout_s * 1000)

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is pending, then stop exporters and servers (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._tracers.shutdown()
        self._meters.shutdown(timeout_s * 1000)
        for stop in self._on_close:
            stop()


def _global_batch(commit: Mapping[str, Any]) -> int:
    """The samples the step trained on, from the plan every commit record carries."""
    mine = list(commit.get("micro_batches", ()))
    per_micro = len(commit.get("samples", ())) // len(mine) if mine else 0
    assignment: Mapping[str, Sequence[int]] = commit.get("assignment", {})
    return per_micro * sum(len(ids) for ids in assignment.values())


def create_telemetry(config: TelemetryConfig, *, node: str, trainjob: str) -> Telemetry:
    """A `Telemetry` exporting where `config` says (none: metrics kept in memory only)."""
    from keepstep.agent.telemetry.export import build_exporters

    exporters = build_exporters(config, node=node)
    return Telemetry(
        node=node,
        trainjob=trainjob,
        metric_readers=exporters.metric_readers,
        span_processors=exporters.span_processors,
        on_close=exporters.on_close,
        prometheus_address=exporters.prometheus_address,
    )
