"""The kopf wiring: which Kubernetes events wake which job's reconcile loop.

Where it sits: `__main__` builds a `Runtime` and runs kopf with `build_registry()`. Every
TrainJob gets one daemon, a loop that runs `Reconciler.reconcile` (in a thread: its calls
block) whenever it is woken, and at least every resync interval. The pods come from a kopf
index of the pods that carry a job label (kept current by kopf's watch), so a reconcile
does not list them. Events of a TrainJob and of its pods wake that loop; wake-ups that
arrive while a reconcile runs coalesce into one more. A TrainJob event caused by our own
status patch (same resourceVersion) is ignored, so a status write never feeds itself. The
finalizer (kopf's on.delete) deletes the job's etcd prefix; pods and the Service go with
the TrainJob through their owner references.

A reconcile that failed (the API server or etcd unreachable) is retried after 1 s, then 2,
4, ... up to the resync interval, and a job whose pod creation backs off is woken when the
backoff ends (`Outcome.retry_at`): the loop never spins. Each reconcile's result and
duration, and the status it leaves the job in, are counted in `Runtime.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kopf

from keepstep.agent.kv import KVError
from keepstep.operator.agents import AgentStore
from keepstep.operator.connection import Connection
from keepstep.operator.kube import KubeError
from keepstep.operator.metrics import Metrics, Result
from keepstep.operator.model import GROUP, JOB_LABEL, KIND, PLURAL, VERSION, pod_summary
from keepstep.operator.reconcile import Reconciler
from keepstep.operator.settings import OperatorSettings

if TYPE_CHECKING:
    from keepstep.operator.etcd_access import JobAccess

log = logging.getLogger(__name__)

FINALIZER = f"{GROUP}/finalizer"
_RETRY_S = 1.0  # after a failed reconcile (the API server or etcd refused), then doubled


def retry_delay(failures: int, most: float) -> float:
    """Seconds before the next try after `failures` failed reconciles in a row."""
    return float(min(most, _RETRY_S * 2.0 ** min(max(failures - 1, 0), 30)))


def next_wait(resync: float, retry_at: float | None, now: float) -> float:
    """How long the loop sleeps when nothing wakes it: the resync interval, or less when
    pod creation may resume sooner (a backoff already over changes nothing)."""
    if retry_at is None or not now < retry_at < now + resync:
        return resync
    return max(retry_at - now, 0.05)


@dataclass
class Runtime:
    """What the handlers share; kopf hands it to every handler as `memo`."""

    settings: OperatorSettings
    connection: Connection
    reconciler: Reconciler
    agents: AgentStore
    access: JobAccess | None = None  # each job's etcd user (None: plain etcd)
    metrics: Metrics = field(default_factory=Metrics)
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    written: dict[tuple[str, str], str] = field(default_factory=dict)  # our last status rv

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        self.wakeup(namespace, name).set()


def configure(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    settings.posting.enabled = False  # our own events say what changed; kopf's would repeat it
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only the pods of TrainJobs reach the operator (filtered by the API server).
    settings.watching.label_selectors["v1", "pods"] = JOB_LABEL
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = max(ours.api_timeout_s, 310.0)
    # Watching named namespaces needs nothing cluster-scoped: no listing of namespaces or
    # CRDs (a namespaced install has only Roles). Cluster-wide, kopf follows the CRDs.
    settings.scanning.disabled = bool(ours.namespaces)


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Runtime, **_: Any) -> None:
        configure(settings, memo.settings)

    @kopf.on.login(registry=registry)
    async def login(memo: Runtime, **_: Any) -> kopf.ConnectionInfo:
        # kopf logs in again after a 401: a rotated token is read afresh then.
        c = memo.connection
        token = await asyncio.to_thread(c.current_token)
        return kopf.ConnectionInfo(
            server=c.server,
            ca_path=c.ca_path,
            insecure=c.insecure,
            scheme="Bearer" if token else None,
            token=token,
            certificate_path=c.cert_path,
            private_key_path=c.key_path,
        )

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def job_event(
        type: str, body: kopf.Body, namespace: str | None, name: str, memo: Runtime, **_: Any
    ) -> None:
        key = (namespace or "default", name)
        if type == "DELETED":
            memo.wakeups.pop(key, None)
            memo.written.pop(key, None)
            memo.metrics.forget(key)
            return
        if body.metadata.get("resourceVersion") == memo.written.get(key):
            return  # our own status patch
        memo.wake(*key)

    @kopf.index("v1", "pods", id="job_pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    async def job_pods(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[tuple[str, str], dict[str, Any]]:
        # kopf fills its indices from its watch before any other handler runs, so a job's
        # first reconcile already sees every pod that existed when the operator started.
        return {(namespace or "default", labels.get(JOB_LABEL, "")): pod_summary(body)}

    @kopf.on.event("v1", "pods", labels={JOB_LABEL: kopf.PRESENT}, registry=registry)
    async def pod_event(
        name: str,
        namespace: str | None,
        labels: kopf.Labels,
        meta: kopf.Meta,
        memo: Runtime,
        **_: Any,
    ) -> None:
        key = (namespace or "default", labels.get(JOB_LABEL, ""))
        for owner in meta.get("ownerReferences") or []:
            if owner.get("kind") == KIND:  # kopf indexed this event before calling us
                memo.reconciler.expectations.observe((*key, str(owner.get("uid"))), name)
        if key in memo.wakeups:  # only jobs that have a loop; pods of others are not ours
            memo.wake(*key)

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=5.0)
    async def run_job(
        namespace: str | None,
        name: str,
        memo: Runtime,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        job_pods: kopf.Index[tuple[str, str], dict[str, Any]] = kwargs["job_pods"]
        namespace = namespace or "default"
        wakeup = memo.wakeup(namespace, name)
        wakeup.set()
        failures = 0
        timeout = memo.settings.resync_s
        while not stopped:
            try:
                await asyncio.wait_for(wakeup.wait(), timeout=timeout)
            except TimeoutError:
                pass
            wakeup.clear()
            if stopped:
                break
            # Copied here, in the event loop that updates the index, not in the thread; the
            # mark says which watch events the copy reflects.
            pods = list(job_pods.get((namespace, name), []))
            mark = memo.reconciler.expectations.mark()
            started = time.monotonic()
            try:
                outcome = await asyncio.to_thread(
                    memo.reconciler.reconcile, namespace, name, pods, mark
                )
            except KubeError as error:
                memo.metrics.failed(Result.ERROR, time.monotonic() - started)
                failures += 1
                delay = retry_delay(failures, memo.settings.resync_s)
                log.warning(
                    "reconcile of %s/%s failed (%d in a row), retrying in %.0f s: %s",
                    namespace, name, failures, delay, error,
                )  # fmt: skip
                await asyncio.sleep(delay)
                wakeup.set()
                continue
            except Exception:
                # A bug must not end the job's loop: say so loudly and retry after a pause.
                memo.metrics.failed(Result.EXCEPTION, time.monotonic() - started)
                log.exception("reconcile of %s/%s raised", namespace, name)
                await asyncio.sleep(memo.settings.resync_s)
                continue
            failures = 0
            memo.metrics.reconciled((namespace, name), outcome, time.monotonic() - started)
            if outcome.gone:
                break
            if outcome.resource_version is not None:
                memo.written[(namespace, name)] = outcome.resource_version
            timeout = next_wait(memo.settings.resync_s, outcome.retry_at, time.time())
        memo.metrics.forget((namespace, name))  # deleted, or no longer this replica's

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    async def cleanup(namespace: str | None, name: str, memo: Runtime, **_: Any) -> None:
        key = f"{namespace or 'default'}.{name}"
        try:
            deleted = await asyncio.to_thread(memo.agents.forget, key)
        except KVError as error:
            memo.metrics.etcd_error()
            raise kopf.TemporaryError(
                f"etcd prefix of {key} not deleted: {error}", delay=2
            ) from error
        log.info("deleted %d etcd keys of %s", deleted, key)
        if memo.access is not None:
            try:
                await asyncio.to_thread(memo.access.revoke, key)
            except KVError as error:
                memo.metrics.etcd_error()
                raise kopf.TemporaryError(
                    f"etcd user of {key} not deleted: {error}", delay=2
                ) from error

    return registry
