"""The operator's Prometheus metrics, and the small HTTP server that serves them.

Where it sits: `__main__` makes one `Metrics` (its own CollectorRegistry, never the
process-global one) and hands it to `kube.Kube` (API requests and errors, pods created,
deleted and refused) and to the kopf handlers (`handlers.Runtime`: each reconcile's result
and duration, and the status it left each job in). With --metrics URL, `MetricsServer`
serves the registry at that one path, GET only, from a daemon thread, until the operator
stops. Every name starts with `keepstep_operator_`:

    reconciles_total{result}              reconciles by result (`Result`)
    reconcile_duration_seconds            one reconcile: reads, decision, writes
    api_requests_total{kind}              the operator's own API calls (not kopf's watches)
    api_errors_total{kind,code}           those that failed: HTTP status, or "none" if
                                          the API server was not reached
    etcd_errors_total                     failed job-etcd calls (agent records, prefix
                                          claims, the cleanup of a deleted job)
    pods_created_total                    pods the API server accepted
    pods_deleted_total{reason}            pods deleted, by `actions.DeleteCause`
    pod_creations_refused_total{reason}   creations refused for what the pod is (Forbidden
                                          by a quota or Pod Security, Invalid, ...)
    jobs{phase}                           TrainJobs by the phase the operator last wrote
    jobs_with_condition{condition}        TrainJobs by each condition that is True
                                          (BelowMinNodes, PodCreateRefused, CrashLoop, ...)

The jobs are those this replica reconciles: with kopf peering, only the active one's.
"""

from __future__ import annotations

import http.server
import logging
import socket
import threading
from collections import Counter as Tally
from collections.abc import Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from keepstep.operator.actions import DeleteCause
from keepstep.operator.model import Phase

if TYPE_CHECKING:
    from keepstep.operator.reconcile import Outcome

log = logging.getLogger(__name__)

PREFIX = "keepstep_operator_"
# A reconcile makes three or four reads and its writes, each bounded by --api-timeout (10 s).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_TIMEOUT_S = 5.0  # a client that does not finish its request in time is dropped
_POLL_S = 0.1  # how soon `stop` is noticed between requests
_BODY_MAX = 64 << 10  # a request body up to this is read and dropped; a longer one is not


class Result(StrEnum):
    """How a reconcile ended."""

    CHANGED = "changed"  # it wrote something (pods, Service, status, events)
    UNCHANGED = "unchanged"  # nothing to do
    ERROR = "error"  # the API server or etcd refused or was unreachable: retried
    EXCEPTION = "exception"  # a bug: logged with its traceback, retried after a resync


class Metrics:
    """The operator's metrics in a registry of their own; the methods are what the
    instrumented code calls (each thread-safe: reconciles run in threads)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.reconciles = counter("reconciles", "TrainJob reconciles by result.", ("result",))
        self.duration = Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Seconds one TrainJob reconcile took (reads, decision, writes).",
            buckets=_BUCKETS,
            registry=r,
        )
        self.api_requests = counter(
            "api_requests",
            "The operator's Kubernetes API requests (not kopf's), by kind.",
            ("kind",),
        )
        self.api_errors = counter(
            "api_errors",
            'Failed Kubernetes API requests, by kind and HTTP status ("none": unreached).',
            ("kind", "code"),
        )
        self.etcd_errors = counter("etcd_errors", "Failed reads and writes of the job etcd.")
        self.created = counter("pods_created", "Pods created (accepted by the API server).")
        self.deleted = counter("pods_deleted", "Pods deleted, by reason.", ("reason",))
        self.refused = counter(
            "pod_creations_refused",
            "Pod creations the API server refused for what the pod is, by its reason.",
            ("reason",),
        )
        self.phases = Gauge(PREFIX + "jobs", "TrainJobs by phase.", ("phase",), registry=r)
        self.conditions = Gauge(
            PREFIX + "jobs_with_condition",
            "TrainJobs by each condition that is True.",
            ("condition",),
            registry=r,
        )
        for result in Result:  # every series exists from the start: rate() sees the first
            self.reconciles.labels(str(result))
        for cause in DeleteCause:
            self.deleted.labels(str(cause))
        for phase in Phase:
            self.phases.labels(str(phase)).set(0)
        self._jobs: dict[tuple[str, str], tuple[Phase, frozenset[str]]] = {}
        self._condition_names: set[str] = set()  # the operator's own condition types
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reconciles

    def reconciled(self, key: tuple[str, str], outcome: Outcome, seconds: float) -> None:
        """One reconcile of job `key` (namespace, name) ended with `outcome`."""
        changed = bool(outcome.decision.actions)
        self.reconciles.labels(str(Result.CHANGED if changed else Result.UNCHANGED)).inc()
        self.duration.observe(seconds)
        if outcome.etcd_errors:
            self.etcd_errors.inc(outcome.etcd_errors)
        if outcome.gone:
            self.forget(key)
        else:
            self.job_status(key, outcome.decision.status)

    def failed(self, result: Result, seconds: float) -> None:
        """A reconcile that raised (`Result.ERROR` or `Result.EXCEPTION`)."""
        self.reconciles.labels(str(result)).inc()
        self.duration.observe(seconds)

    def job_status(self, key: tuple[str, str], status: Mapping[str, Any]) -> None:
        """The status the operator wants job `key` to have; one without a phase of ours
        (a job being deleted) leaves the job as it was counted."""
        phase = Phase.parse(status.get("phase"))
        if phase is None:
            return
        listed = status.get("conditions") or []
        true = frozenset(
            str(c["type"]) for c in listed if isinstance(c, Mapping) and c.get("status") == "True"
        )
        with self._lock:
            self._jobs[key] = (phase, true)
            self._count()

    def forget(self, key: tuple[str, str]) -> None:
        """Job `key` is gone (deleted, or no longer this replica's)."""
        with self._lock:
            if self._jobs.pop(key, None) is not None:
                self._count()

    def _count(self) -> None:
        phases = Tally(phase for phase, _ in self._jobs.values())
        for phase in Phase:
            self.phases.labels(str(phase)).set(phases[phase])
        conditions = Tally(c for _, true in self._jobs.values() for c in true)
        # A condition counted before and now on no job drops to 0 rather than vanishing.
        self._condition_names.update(conditions)
        for name in self._condition_names:
            self.conditions.labels(name).set(conditions[name])

    # ------------------------------------------------------------------ API calls

    def etcd_error(self) -> None:
        self.etcd_errors.inc()

    def api_request(self, kind: str) -> None:
        self.api_requests.labels(kind).inc()

    def api_error(self, kind: str, status: int) -> None:
        """A request of `kind` failed: HTTP `status`, or 0 when no answer came."""
        self.api_errors.labels(kind, str(status) if status else "none").inc()

    def pod_created(self) -> None:
        self.created.inc()

    def pod_deleted(self, cause: DeleteCause) -> None:
        self.deleted.labels(str(cause)).inc()

    def pod_refused(self, reason: str) -> None:
        self.refused.labels(reason).inc()


class MetricsServer:
    """Serves one registry at one path over HTTP (GET; anything else is 404), one request
    at a time from a daemon thread, each within `timeout` seconds; `stop` ends it."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        path: str,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.path, self.timeout = path, timeout
        server = _Server6 if ":" in host else _Server
        self._server = server((host, port), _handler(registry, path, timeout))
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="keepstep-metrics",
            daemon=True,
        )

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when asked for port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics at http://%s:%d%s", self._server.server_address[0], self.port, self.path)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=self.timeout)
        self._server.server_close()


class _Server(http.server.HTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-answer is its own business: no traceback on stderr.
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6  # an IPv6 host, such as ::


def _handler(
    registry: CollectorRegistry, path: str, request_timeout: float
) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        # The socket's: a client that stalls mid-request is dropped, and the next is served.
        timeout = request_timeout
        server_version = "keepstep-operator"

        def do_GET(self) -> None:
            if urlsplit(self.path).path != path:
                self._not_found()
                return
            encode, content_type = choose_encoder(self.headers.get("Accept", ""))
            body = encode(registry)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _not_found(self) -> None:
            # A small body is read first, so that closing does not reset the connection
            # before the client read the answer; a larger one is never read.
            self.close_connection = True
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            if 0 < length <= _BODY_MAX:
                self.rfile.read(length)
            self.send_error(404)

        do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _not_found

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    return Handler
