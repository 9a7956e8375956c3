"""One reconcile of one TrainJob: observe, decide, apply.

Where it sits: the kopf handlers call `Reconciler.reconcile(namespace, name, pods)` (in a
thread) on every event and timer, with the job's pods from kopf's index; the benchmark and
the tests call it directly, and without `pods` it lists them. Each reconcile reads the
TrainJob, its Service and its NetworkPolicy from the API server (three reads; four with the
pod list) and the job's records from etcd (one read). Our own creates and deletes that the
pod cache does not show yet are laid over it (`expect`); pod names come from
status.nextPodIndex and the pods that exist, so a repeated create only meets AlreadyExists.
etcd being unreachable does not stop pod replacement: the decision is then made without
the agents' records.

A decision is applied in two stages: its writes (NetworkPolicy, Service, deletions,
creations), then its events and status patch. When the API server refuses pod creations,
the second stage comes from `refusal.after_refusal` instead (the reasons, the backoff, the
condition), so a refused creation is never announced as created and the operator does not
retry it before status.createBackoffUntil.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from keepstep.agent.kv import KVError
from keepstep.operator.actions import Action, Applied, ClaimPrefix, Decision, Event, PatchStatus
from keepstep.operator.agents import AgentStore
from keepstep.operator.decide import decide, decide_invalid
from keepstep.operator.errors import SpecError
from keepstep.operator.expect import Expectations
from keepstep.operator.kube import KubeError, Tally
from keepstep.operator.model import AgentView, Job, JobRef, PodView, parse_time
from keepstep.operator.refusal import after_refusal
from keepstep.operator.settings import DecideConfig

if TYPE_CHECKING:  # its etcd client is heavy; --help must not wait for it
    from keepstep.operator.etcd_access import JobAccess

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What one reconcile did: its decision, its API calls, how long it took."""

    decision: Decision
    tally: Tally = field(default_factory=Tally)
    etcd_reads: int = 0
    etcd_writes: int = 0
    etcd_errors: int = 0  # reads and writes that failed (the reconcile went on without them)
    seconds: float = 0.0
    decide_seconds: float = 0.0
    gone: bool = False  # the TrainJob no longer exists
    resource_version: str | None = None  # the TrainJob's, after our own status patch
    retry_at: float | None = None  # pod creation backs off until then (status.createBackoffUntil)


class KubeClient(Protocol):
    """What a reconcile needs from the API server (`kube.Kube`; a fake in unit tests)."""

    def get_job(self, namespace: str, name: str, tally: Tally | None = None) -> Any: ...
    def list_pods(self, namespace: str, job_name: str, tally: Tally | None = None) -> list[Any]: ...
    def service_exists(self, namespace: str, name: str, tally: Tally | None = None) -> bool: ...
    def network_policy_exists(
        self, namespace: str, name: str, tally: Tally | None = None
    ) -> bool: ...
    def apply(
        self, job: JobRef, actions: Sequence[Action], tally: Tally | None = None
    ) -> Applied: ...


class Reconciler:
    def __init__(
        self,
        kube: KubeClient,
        agents: AgentStore,
        config: DecideConfig,
        clock: Callable[[], float] = time.time,
        expectations: Expectations | None = None,
        access: JobAccess | None = None,
    ) -> None:
        self.kube, self.agents, self.config, self.clock = kube, agents, config, clock
        self.access = access  # each job's etcd user and Secret (None: plain etcd)
        self.expectations = expectations if expectations is not None else Expectations()

    def reconcile(
        self,
        namespace: str,
        name: str,
        pods: Sequence[Mapping[str, Any]] | None = None,
        mark: int | None = None,
    ) -> Outcome:
        """Bring one TrainJob one step closer to its spec; raises KubeError if an API
        call failed (the caller retries at the next event or resync).

        `pods`: the job's pods from a cache (kopf's index), snapshot at `mark`
        (`Expectations.mark`); None lists them from the API server. Our own creates and
        deletes that the snapshot cannot show yet are laid over it."""
        started = time.monotonic()
        tally = Tally()
        raw = self.kube.get_job(namespace, name, tally)
        if raw is None:
            return Outcome(Decision((), "gone"), tally, gone=True)
        try:
            job = Job.from_object(raw)
        except SpecError as error:
            decision = decide_invalid(raw, str(error), self.clock())
            applied = self.kube.apply(JobRef.from_object(raw), decision.actions, tally)
            return Outcome(
                decision,
                tally,
                seconds=time.monotonic() - started,
                resource_version=applied.version,
            )
        ident = (namespace, name, job.uid)
        if self.access is not None:
            self._grant(job)
        if pods is None:  # a list is read after our own writes: nothing to lay over it
            self.expectations.forget(ident)
            pods = self.kube.list_pods(namespace, name, tally)
        views = [v for obj in pods if (v := PodView.from_object(obj, job.uid)) is not None]
        views = self.expectations.adjust(ident, views, mark)
        service = self.kube.service_exists(namespace, name, tally)
        policy = self.kube.network_policy_exists(namespace, name, tally)
        agents = self._read_agents(job)
        etcd_errors = int(agents is None)
        t0 = time.perf_counter()
        now = self.clock()
        decision = decide(
            job,
            views,
            agents,
            now,
            config=self.config,
            service_exists=service,
            policy_exists=policy,
        )
        decide_s = time.perf_counter() - t0
        etcd_writes = 0
        for claim in decision.of(ClaimPrefix):
            try:
                self.agents.claim(claim)
                etcd_writes += 1 + int(claim.reset)
            except KVError as error:
                etcd_errors += 1
                log.warning("could not claim the etcd prefix of %s: %s", job.key, error)
        writes = [
            a for a in decision.actions if not isinstance(a, ClaimPrefix | Event | PatchStatus)
        ]
        self.expectations.record(ident, decision)
        try:
            applied = self.kube.apply(job.ref, writes, tally) if writes else Applied()
            if applied.refused:
                self.expectations.dropped(ident, [r.pod for r in applied.refused])
                decision = after_refusal(job, decision, applied.refused, now, self.config)
            reports = [a for a in decision.actions if isinstance(a, Event | PatchStatus)]
            version = self.kube.apply(job.ref, reports, tally).version if reports else None
        except KubeError:
            self.expectations.forget(ident)
            raise
        seconds = time.monotonic() - started
        if decision.actions:
            log.info("%s: %s (%.2f s)", job.key, decision.reason, seconds)
        return Outcome(
            decision,
            tally,
            etcd_reads=1,
            etcd_writes=etcd_writes,
            etcd_errors=etcd_errors,
            seconds=seconds,
            decide_seconds=decide_s,
            resource_version=version,
            retry_at=parse_time(decision.status.get("createBackoffUntil")),
        )

    def _grant(self, job: Job) -> None:
        """The job's etcd access before its pods: a failure is retried like a refused
        API call (no pod is created that could not reach etcd)."""
        assert self.access is not None
        try:
            self.access.ensure(job)
        except KVError as error:
            raise KubeError(f"{job.key}: etcd access not granted: {error}") from error

    def _read_agents(self, job: Job) -> AgentView | None:
        try:
            return self.agents.read(job.key)
        except KVError as error:
            log.warning(
                "etcd unreachable for %s, deciding without agent records: %s", job.key, error
            )
            return None
