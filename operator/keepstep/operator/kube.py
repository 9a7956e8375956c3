"""The one module that talks to the Kubernetes API (besides kopf's own watching).

Where it sits: `reconcile` reads a TrainJob, its pods, its Service and its NetworkPolicy
through `Kube`, and hands it the Kubernetes actions of a `Decision` to apply. Requests are
plain JSON over one pooled HTTPS client (the credentials: `connection`); every request has
a timeout and is counted, per kind and as reads or writes, so tests and the benchmark can
assert that a reconcile which changes nothing writes nothing (and in the operator's
`metrics`, with its failures and the pods created, deleted and refused). Applying is
idempotent: creating what exists or deleting what is gone is not an error. Pods are
created in parallel; a creation the API server refuses for what the pod is (quota, Pod
Security, an invalid field: a 4xx other than 409 and 429) comes back as a `Refusal`, for
the reconcile to back off and say why; other failures (unreachable, 5xx, throttled) raise
`KubeError`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from keepstep.operator.actions import (
    Action,
    Applied,
    CreatePod,
    DeletePod,
    EnsureNetworkPolicy,
    EnsureService,
    Event,
    PatchStatus,
    Refusal,
)
from keepstep.operator.connection import Connection
from keepstep.operator.errors import OperatorError
from keepstep.operator.metrics import Metrics
from keepstep.operator.model import (
    GROUP,
    JOB_LABEL,
    KIND,
    PLURAL,
    VERSION,
    JobRef,
    format_time,
)

log = logging.getLogger(__name__)

COMPONENT = "keepstep-operator"


class KubeError(OperatorError):
    """The API server refused a request or could not be reached in time; `reason` and
    `api_message` are those of the Status object it answered with, if any."""

    def __init__(
        self, message: str, status: int = 0, reason: str = "", api_message: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.reason, self.api_message = status, reason, api_message

    @property
    def refused(self) -> bool:
        """The request itself is at fault: sending it again unchanged cannot succeed."""
        return 400 <= self.status < 500 and self.status not in (409, 429)


@dataclass
class Tally:
    """API calls of one reconcile (or of the whole process): per kind, reads and writes."""

    calls: Counter[str] = field(default_factory=Counter)
    reads: int = 0
    writes: int = 0

    def add(self, kind: str, write: bool) -> None:
        self.calls[kind] += 1
        if write:
            self.writes += 1
        else:
            self.reads += 1


_TOKEN_REREAD_S = 60.0  # a rotated service account token is picked up within a minute
_JOBS = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}/{{name}}"
_POLICIES = "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"


class Kube:
    def __init__(
        self,
        connection: Connection,
        timeout: float = 10.0,
        parallelism: int = 16,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.connection, self.timeout, self.parallelism = connection, timeout, parallelism
        self.clock = clock
        self.metrics = metrics if metrics is not None else Metrics()
        self._headers = {"Accept": "application/json", "User-Agent": COMPONENT}
        self._token: tuple[float, str | None] = (-math.inf, None)  # (read at, token)
        self._http = urllib3.PoolManager(
            maxsize=parallelism,
            cert_reqs="CERT_NONE" if connection.insecure else "CERT_REQUIRED",
            ca_certs=connection.ca_path,
            cert_file=connection.cert_path,
            key_file=connection.key_path,
            retries=False,
        )
        self._lock = threading.Lock()
        self.total = Tally()
        self._host = socket.gethostname()

    # ------------------------------------------------------------------ requests

    def _request(
        self,
        kind: str,
        method: str,
        path: str,
        tally: Tally | None,
        body: Any = None,
        content_type: str = "application/json",
        ok_missing: bool = False,
    ) -> Any:
        """One API call; the decoded JSON answer, or None for a 404/409 that `ok_missing`
        (or a create of something that exists) makes harmless."""
        write = method != "GET"
        with self._lock:
            self.total.add(kind, write)
            if tally is not None:
                tally.add(kind, write)
        self.metrics.api_request(kind)
        headers = dict(self._headers)
        token = self._current_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            response = self._http.request(
                method,
                self.connection.server + path,
                body=data,
                headers=headers,
                timeout=urllib3.Timeout(total=self.timeout),
                preload_content=True,
            )
        except urllib3.exceptions.HTTPError as error:
            self.metrics.api_error(kind, 0)
            raise KubeError(f"{method} {path}: {error}") from error
        if response.status == 404 and ok_missing:
            return None
        reason, message = _status_of(response.data) if response.status >= 300 else ("", "")
        if response.status == 409 and method == "POST" and reason in ("", "AlreadyExists"):
            return None  # AlreadyExists: an earlier reconcile created it
        if response.status >= 300:
            self.metrics.api_error(kind, response.status)
            text = response.data.decode(errors="replace")[:500]
            raise KubeError(
                f"{method} {path}: HTTP {response.status}: {text}", response.status, reason, message
            )
        return json.loads(response.data) if response.data else {}

    def _current_token(self) -> str | None:
        read_at, token = self._token
        if time.monotonic() - read_at > _TOKEN_REREAD_S:
            try:
                token = self.connection.current_token()
            except OSError as error:
                raise KubeError(f"service account token unreadable: {error}") from error
            self._token = (time.monotonic(), token)
        return token

    # ------------------------------------------------------------------ reads

    def get_job(self, namespace: str, name: str, tally: Tally | None = None) -> Any:
        """The TrainJob as a dict, or None if it does not exist."""
        path = _JOBS.format(ns=quote(namespace), name=quote(name))
        return self._request("get_job", "GET", path, tally, ok_missing=True)

    def list_pods(self, namespace: str, job_name: str, tally: Tally | None = None) -> list[Any]:
        query = urlencode({"labelSelector": f"{JOB_LABEL}={job_name}"})
        path = f"/api/v1/namespaces/{quote(namespace)}/pods?{query}"
        answer = self._request("list_pods", "GET", path, tally)
        return list(answer.get("items") or [])

    def service_exists(self, namespace: str, name: str, tally: Tally | None = None) -> bool:
        path = f"/api/v1/namespaces/{quote(namespace)}/services/{quote(name)}"
        return self._request("get_service", "GET", path, tally, ok_missing=True) is not None

    def get_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's data, decoded (None: no such Secret)."""
        path = f"/api/v1/namespaces/{quote(namespace)}/secrets/{quote(name)}"
        answer = self._request("get_secret", "GET", path, None, ok_missing=True)
        if answer is None:
            return None
        data = answer.get("data") or {}
        return {str(k): base64.b64decode(v) for k, v in data.items()}

    def create_secret(self, manifest: Mapping[str, Any]) -> None:
        """Create a Secret (one that exists already is left as it is)."""
        namespace = str(manifest["metadata"]["namespace"])
        path = f"/api/v1/namespaces/{quote(namespace)}/secrets"
        self._request("create_secret", "POST", path, None, body=manifest)

    def network_policy_exists(self, namespace: str, name: str, tally: Tally | None = None) -> bool:
        path = f"{_POLICIES.format(ns=quote(namespace))}/{quote(name)}"
        answer = self._request("get_network_policy", "GET", path, tally, ok_missing=True)
        return answer is not None

    # ------------------------------------------------------------------ writes

    def apply(self, job: JobRef, actions: Sequence[Action], tally: Tally | None = None) -> Applied:
        """Carry out the Kubernetes actions in order (pod creations in parallel); returns
        the TrainJob's resourceVersion after a status patch, if there was one, and the
        refused pod creations. Raises KubeError, after trying every action, if any other
        action failed."""
        ns = quote(job.namespace)
        version: str | None = None
        errors: list[str] = []
        refused: list[Refusal] = []
        creates = [a for a in actions if isinstance(a, CreatePod)]
        for action in actions:
            try:
                if isinstance(action, EnsureNetworkPolicy):
                    path = _POLICIES.format(ns=ns)
                    manifest = dict(action.manifest)
                    self._request("create_network_policy", "POST", path, tally, manifest)
                elif isinstance(action, EnsureService):
                    path = f"/api/v1/namespaces/{ns}/services"
                    self._request("create_service", "POST", path, tally, dict(action.manifest))
                elif isinstance(action, DeletePod):
                    self._delete_pod(job.namespace, action, tally)
                elif isinstance(action, CreatePod) and action is creates[0]:
                    for outcome in self._create_pods(job.namespace, creates, tally):
                        if isinstance(outcome, Refusal):
                            refused.append(outcome)
                        else:
                            errors.append(outcome)
                elif isinstance(action, PatchStatus):
                    version = self._patch_status(job, action.patch, tally)
                elif isinstance(action, Event):
                    self._event(job, action, tally)
            except KubeError as error:
                if isinstance(action, Event):
                    log.warning("event not posted: %s", error)  # events are best effort
                else:
                    errors.append(str(error))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise KubeError(f"{len(errors)} actions on {job.key} failed: {errors[0]}{more}")
        return Applied(version, tuple(refused))

    def _create_pods(
        self, namespace: str, creates: Sequence[CreatePod], tally: Tally | None
    ) -> list[str | Refusal]:
        """What failed: a Refusal per refused pod, an error text per other failure."""
        path = f"/api/v1/namespaces/{quote(namespace)}/pods"

        def create(action: CreatePod) -> str | Refusal | None:
            try:
                created = self._request("create_pod", "POST", path, tally, dict(action.manifest))
            except KubeError as error:
                if error.refused:
                    message = error.api_message or str(error)
                    self.metrics.pod_refused(error.reason or "Refused")
                    return Refusal(action.name, error.status, error.reason or "Refused", message)
                return str(error)
            if created is not None:  # None: it existed (an earlier reconcile created it)
                self.metrics.pod_created()
            return None

        return _parallel(create, creates, self.parallelism)

    def _delete_pod(self, namespace: str, action: DeletePod, tally: Tally | None) -> None:
        path = f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(action.name)}"
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if action.grace_seconds is not None:
            body["gracePeriodSeconds"] = action.grace_seconds
        if self._request("delete_pod", "DELETE", path, tally, body, ok_missing=True) is not None:
            self.metrics.pod_deleted(action.cause)

    def _patch_status(
        self, job: JobRef, patch: Mapping[str, Any], tally: Tally | None
    ) -> str | None:
        path = _JOBS.format(ns=quote(job.namespace), name=quote(job.name)) + "/status"
        answer = self._request(
            "patch_status",
            "PATCH",
            path,
            tally,
            {"status": dict(patch)},
            content_type="application/merge-patch+json",
            ok_missing=True,
        )
        return None if answer is None else str(answer["metadata"]["resourceVersion"])

    def _event(self, job: JobRef, event: Event, tally: Tally | None) -> None:
        now = format_time(self.clock())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{job.name}.", "namespace": job.namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": job.name,
                "namespace": job.namespace,
                "uid": job.uid,
            },
            "type": str(event.type),
            "reason": event.reason,
            "message": event.message[:1024],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._host,
        }
        path = f"/api/v1/namespaces/{quote(job.namespace)}/events"
        self._request("create_event", "POST", path, tally, body)


def _status_of(data: bytes) -> tuple[str, str]:
    """(reason, message) of a Status object the API server answered with, or ("", "")."""
    try:
        status = json.loads(data)
    except ValueError:
        return "", ""
    if not isinstance(status, dict):
        return "", ""
    return str(status.get("reason") or ""), str(status.get("message") or "")


def _parallel(
    fn: Callable[[CreatePod], str | Refusal | None], items: Sequence[CreatePod], workers: int
) -> list[str | Refusal]:
    if len(items) == 1:
        result = fn(items[0])
        return [] if result is None else [result]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return [r for r in pool.map(fn, items) if r is not None]
