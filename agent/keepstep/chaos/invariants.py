"""The invariants every chaos run must keep: pure functions of what the run left behind.

Where it sits: after each run, `runner.py` hands `check` the run's summary.json, its
event log, the fault-free reference run (`Reference`) and what it observed from outside
(`Observation`: exit code, end time, faults applied, leftovers). `check` returns each
invariant's verdict and one line per violation; nothing here touches a process or file.

    final_parameters_equal   params_sha256 equals the fault-free run's, every step trained
    global_batch_constant    every step: all micro-batches, global_batch samples, once
    every_sample_once        the ledger: nothing lost or duplicated, the reference's samples
    no_hang_beyond_bound     no pause in committed steps longer than the detection bound,
                             and the run ends within the shutdown bound of its last step
    no_process_left_behind   no process, snapshot file or cgroup of the run remains
    every_recovery_recorded  every epoch change has a complete recovery record, and every
                             fault that takes a member out or adds one is followed by one
    clean_exit               `keepstep run` and every agent it did not kill exited 0
    goodput_target           (when a target is set) samples/s >= min_goodput x reference
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keepstep.agent.protocol.events import EventKind
from keepstep.agent.protocol.recovery import PHASES
from keepstep.chaos.model import Checks, FaultKind, Job

Event = Mapping[str, Any]
INVARIANTS = (
    "final_parameters_equal",
    "global_batch_constant",
    "every_sample_once",
    "no_hang_beyond_bound",
    "no_process_left_behind",
    "every_recovery_recorded",
    "clean_exit",
)
_PHASES = (*(f"{p}_s" for p in PHASES[:-1]), "mttr_s")  # a summary record's times
_SHOWN = 5  # per-step violations listed before the rest is counted
_KILLED = frozenset({FaultKind.KILL_NODE.value, FaultKind.HANG_NODE.value})
# A joining node starts its processes first (seconds): its admission may come much later.
_LATE_RECOVERY = frozenset({FaultKind.JOIN_NODE})


@dataclass(frozen=True)
class Reference:
    """What the fault-free run of the same job produced."""

    params_sha256: str
    steps: int
    global_batch: int
    # Per step, per micro-batch id: a digest of its sample ids (they are keyed by seed,
    # step and micro-batch id, so any member computing it must have used the same ones).
    micro_batch_samples: tuple[tuple[str, ...], ...]
    samples_per_s: float
    checkpoints: tuple[tuple[int, str], ...] = ()  # (step, sha256) of durable checkpoints


@dataclass(frozen=True)
class Observation:
    """What the runner saw of one run from outside."""

    exit_code: int | None
    ended_t: float
    faults: tuple[Mapping[str, Any], ...] = ()  # applied fault records (with t, or skipped)
    leftovers: tuple[str, ...] = ()
    checkpoints: tuple[tuple[int, str], ...] = ()  # (step, sha256) of durable checkpoints


@dataclass(frozen=True)
class Verdict:
    invariants: dict[str, bool]
    violations: list[str]
    goodput: dict[str, float | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.invariants.values())


def explaining(faults: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The applied faults that can explain a recovery, in the order they were applied: only
    those that change the membership (a restarted operator or a slowed node must not take
    the credit for an epoch). The run summary and `runner.attribute` match epochs to these."""
    applied = [f for f in faults if f.get("t") is not None]
    return sorted(
        (f for f in applied if FaultKind(f["kind"]).expects_recovery), key=lambda f: float(f["t"])
    )


def final_commits(events: Sequence[Event]) -> dict[int, list[Event]]:
    """Per step, the commits of its newest epoch (what the final parameters came from)."""
    newest: dict[int, int] = {}
    for e in events:
        if e["kind"] == EventKind.COMMIT:
            newest[e["step"]] = max(newest.get(e["step"], -1), e["epoch"])
    out: dict[int, list[Event]] = {}
    for e in events:
        if e["kind"] == EventKind.COMMIT and e["epoch"] == newest[e["step"]]:
            out.setdefault(e["step"], []).append(e)
    return out


def micro_batch_digests(events: Sequence[Event], steps: int, n_micro: int) -> list[list[str]]:
    """Per step and micro-batch id, a digest of the samples its final commit used ("" if
    no commit record shows it)."""
    final = final_commits(events)
    out = []
    for step in range(steps):
        row = [""] * n_micro
        for c in final.get(step, []):
            mbs, samples = list(c["micro_batches"]), list(c.get("samples", []))
            if not mbs or len(samples) % len(mbs):
                continue  # _global_batch reports it
            k = len(samples) // len(mbs)
            for j, mb in enumerate(mbs):
                if 0 <= mb < n_micro:
                    row[mb] = _digest(samples[j * k : (j + 1) * k])
        out.append(row)
    return out


def _digest(ids: Sequence[int]) -> str:
    return hashlib.sha1(repr(list(ids)).encode()).hexdigest()[:12]


def samples_per_s(events: Sequence[Event], job: Job) -> float | None:
    """Committed samples over the training window: from the first commit to the first
    finish (the final epoch's members finish together; a member restarted after that
    adds no work)."""
    commits = [float(e["t"]) for e in events if e["kind"] == EventKind.COMMIT]
    finishes = [float(e["t"]) for e in events if e["kind"] == EventKind.FINISH]
    if not commits or not finishes or min(finishes) <= min(commits):
        return None
    return job.steps * job.global_batch / (min(finishes) - min(commits))


def reference_from(
    summary: Mapping[str, Any],
    events: Sequence[Event],
    job: Job,
    checkpoints: tuple[tuple[int, str], ...] = (),
) -> Reference:
    rate = samples_per_s(events, job)
    digests = micro_batch_digests(events, job.steps, job.n_micro)
    if summary.get("params_sha256") is None or rate is None or summary["steps"] != job.steps:
        raise ValueError("the fault-free reference run did not finish cleanly")
    if any("" in row for row in digests):
        raise ValueError("the fault-free reference run lacks commit records")
    return Reference(
        str(summary["params_sha256"]),
        job.steps,
        job.global_batch,
        tuple(tuple(row) for row in digests),
        rate,
        checkpoints,
    )


def check(
    summary: Mapping[str, Any] | None,
    events: Sequence[Event],
    reference: Reference,
    seen: Observation,
    job: Job,
    checks: Checks,
) -> Verdict:
    found: dict[str, list[str]] = {
        "final_parameters_equal": _parameters(summary, reference, job, seen.checkpoints),
        "global_batch_constant": _global_batch(summary, events, job),
        "every_sample_once": _samples(summary, events, reference, job),
        "no_hang_beyond_bound": _no_hang(events, seen, checks),
        "no_process_left_behind": [f"left behind: {item}" for item in seen.leftovers],
        "every_recovery_recorded": _recoveries(summary, events, seen, checks),
        "clean_exit": _clean_exit(summary, seen),
    }
    rate = samples_per_s(events, job) if summary is not None else None
    ratio = rate / reference.samples_per_s if rate is not None else None
    goodput: dict[str, float | None] = {
        "samples_per_s": rate,
        "reference_samples_per_s": reference.samples_per_s,
        "ratio": ratio,
    }
    if checks.min_goodput is not None:
        found["goodput_target"] = (
            []
            if ratio is not None and ratio >= checks.min_goodput
            else [f"goodput ratio {ratio} is below the target {checks.min_goodput}"]
        )
    return Verdict(
        {name: not v for name, v in found.items()},
        [f"{name}: {line}" for name, v in found.items() for line in v],
        goodput,
    )


def _parameters(
    summary: Mapping[str, Any] | None,
    ref: Reference,
    job: Job,
    checkpoints: tuple[tuple[int, str], ...],
) -> list[str]:
    sharded = job.shard is not None  # its checkpoint records hash their parts' manifests
    out = [] if sharded else _diverged(checkpoints, ref.checkpoints)
    if summary is None:
        return ["the run wrote no summary (it did not end)", *out]
    if summary.get("params_sha256_disagree"):
        out.append(f"members disagree on the parameters: {summary['params_sha256_disagree']}")
    if summary.get("steps") != job.steps:
        out.append(f"trained {summary.get('steps')} steps of {job.steps}")
    if summary.get("params_sha256") != ref.params_sha256:
        out.append(
            f"params_sha256 {summary.get('params_sha256')} differs from the fault-free "
            f"run's {ref.params_sha256}"
        )
    return out


def _diverged(mine: tuple[tuple[int, str], ...], ref: tuple[tuple[int, str], ...]) -> list[str]:
    """Where the training state first differed, by the checkpoints both runs wrote."""
    theirs = dict(ref)
    common = [(step, sha) for step, sha in mine if step in theirs]
    for i, (step, sha) in enumerate(common):
        if sha != theirs[step]:
            since = f"equal at step {common[i - 1][0]}" if i else "no earlier common checkpoint"
            return [f"the state first differs at the checkpoint of step {step} ({since})"]
    return []


def _global_batch(
    summary: Mapping[str, Any] | None, events: Sequence[Event], job: Job
) -> list[str]:
    """Every step's final epoch planned all micro-batches once, and each member that left a
    commit record computed exactly its share with `micro_batch` samples each. A member may
    leave no record (killed between the collective and its report): its share still went
    into the sum, because nobody commits a step whose collective lost a contribution."""
    out = []
    if summary is not None and summary.get("global_batch") != job.global_batch:
        out.append(f"summary global_batch {summary.get('global_batch')} != {job.global_batch}")
    final = final_commits(events)
    bad = []
    for step in range(job.steps):
        commits = final.get(step, [])
        if not commits:
            bad.append(f"step {step}: never committed")
            continue
        plans = {repr(sorted(c["assignment"].items())) for c in commits}
        planned = sorted(mb for ids in commits[0]["assignment"].values() for mb in ids)
        if len(plans) > 1 or planned != list(range(job.n_micro)):
            bad.append(f"step {step}: planned micro-batches {planned} ({len(plans)} plans)")
        for c in commits:
            mine, samples = list(c["micro_batches"]), len(c.get("samples", []))
            if mine != list(c["assignment"].get(c["member"], [])):
                bad.append(f"step {step}: {c['member']} computed {mine}, not its share")
            elif samples != len(mine) * job.micro_batch:
                bad.append(f"step {step}: {c['member']} used {samples} samples for {mine}")
    if len(bad) > _SHOWN:
        bad[_SHOWN:] = [f"... and {len(bad) - _SHOWN} more"]
    return out + bad


def _samples(
    summary: Mapping[str, Any] | None, events: Sequence[Event], ref: Reference, job: Job
) -> list[str]:
    out = []
    if summary is not None:
        s = summary["samples"]
        if s["seen_once"] != s["expected"] or s["lost"] or s["duplicated"]:
            out.append(
                f"ledger: {s['seen_once']} of {s['expected']} once, {s['lost']} lost, "
                f"{s['duplicated']} duplicated"
            )
        out += [f"plan mismatch: {m}" for m in s.get("plan_mismatches", [])]
    mine = micro_batch_digests(events, job.steps, job.n_micro)
    differ = [
        (step, mb)
        for step, (row, ref_row) in enumerate(zip(mine, ref.micro_batch_samples, strict=False))
        for mb, (d, ref_d) in enumerate(zip(row, ref_row, strict=True))
        if d and d != ref_d
    ]
    if differ:
        more = f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else ""
        out.append(
            f"(step, micro-batch) {differ[:_SHOWN]}{more} used other samples than in the "
            "fault-free run"
        )
    return out


def _no_hang(events: Sequence[Event], seen: Observation, checks: Checks) -> list[str]:
    finishes = [float(e["t"]) for e in events if e["kind"] == EventKind.FINISH]
    done = min(finishes, default=float("inf"))  # the job's work is over at the first finish
    steps = (EventKind.COMMIT, EventKind.FINISH)
    times = sorted(float(e["t"]) for e in events if e["kind"] in steps and e["t"] <= done)
    out = []
    for a, b in itertools.pairwise(times):
        if b - a > checks.detection_bound_s:
            out.append(
                f"no step committed for {b - a:.1f} s (bound {checks.detection_bound_s:g} s)"
            )
    if not finishes:
        out.append("no member finished")
    elif seen.ended_t - done > checks.shutdown_bound_s:
        out.append(
            f"the run ended {seen.ended_t - done:.1f} s after its first member finished "
            f"(bound {checks.shutdown_bound_s:g} s)"
        )
    return out


def _recoveries(
    summary: Mapping[str, Any] | None,
    events: Sequence[Event],
    seen: Observation,
    checks: Checks,
) -> list[str]:
    agreed: dict[int, float] = {}
    for e in events:
        if e["kind"] == EventKind.EPOCH_AGREED and e["epoch"] > 0:
            agreed.setdefault(int(e["epoch"]), float(e["t"]))
    records = {int(r["epoch"]): r for r in (summary or {}).get("recoveries", [])}
    done = min((float(e["t"]) for e in events if e["kind"] == EventKind.FINISH), default=None)
    out = []
    for epoch in sorted(agreed):
        r = records.get(epoch)
        late = (
            f" (agreed {agreed[epoch] - done:.1f} s after the first member finished)"
            if done is not None and agreed[epoch] > done
            else ""
        )
        if r is None:
            out.append(f"epoch {epoch} has no recovery record{late}")
        elif not r.get("cause") or any(not isinstance(r.get(p), int | float) for p in _PHASES):
            missing = [p for p in _PHASES if not isinstance(r.get(p), int | float)]
            out.append(
                f"epoch {epoch} ({r.get('cause')}: {r.get('reason')}): recovery record "
                f"without {', '.join(missing) or 'a cause'}{late}"
            )
    last = max((float(e["t"]) for e in events), default=seen.ended_t)
    epochs = [e for e in events if e["kind"] == EventKind.EPOCH_AGREED]
    for fault in seen.faults:
        kind = FaultKind(fault["kind"])
        if fault.get("t") is None or not kind.expects_recovery:
            continue
        if kind is FaultKind.CORRUPT_SNAPSHOT and not fault.get("detail", {}).get("killed"):
            continue  # nobody had to load the corrupted slot
        t = float(fault["t"])
        if _outside_the_job(fault.get("node"), t, epochs):
            continue  # it hit a node the job had already left out: nothing to recover
        until = last if kind in _LATE_RECOVERY else t + checks.detection_bound_s
        if not any(t <= at <= until for at in agreed.values()):
            out.append(
                f"fault #{fault['index']} {fault['spec']} (t={t:.3f}) was not followed by "
                f"a recovery within {until - t:.1f} s"
            )
    return out


def _outside_the_job(node: object, t: float, epochs: Sequence[Event]) -> bool:
    """Whether `node` had no member in the epoch in force at `t` (excluded, not back yet)."""
    if not isinstance(node, str):
        return False
    before = [e for e in epochs if float(e["t"]) <= t]
    if not before:
        return False
    members = max(before, key=lambda e: int(e["epoch"])).get("members") or []
    return not any(str(m).partition("/")[0] == node for m in members)


def _clean_exit(summary: Mapping[str, Any] | None, seen: Observation) -> list[str]:
    out = []
    ended = {
        str(f["node"])
        for f in seen.faults
        if f.get("t") is not None
        and f["kind"] in _KILLED
        and not f.get("detail", {}).get("resume_after_s")
    }
    if seen.exit_code != 0 and not _only_our_kills(summary, seen.exit_code, ended):
        out.append(f"keepstep run exited with {seen.exit_code}")
    for node, code in ((summary or {}).get("agent_exit_codes") or {}).items():
        if code != 0 and node not in ended:
            out.append(f"agent {node} exited with {code}")
    return out


def _only_our_kills(
    summary: Mapping[str, Any] | None, exit_code: int | None, ended: set[str]
) -> bool:
    """Whether `keepstep run` exited 1 only because agents this harness killed exited by
    their signal: the launcher injected none of the harness's faults, so it counts those
    exits among its failures (`summary["failures"]`, one sentence per agent)."""
    failures = (summary or {}).get("failures")
    if exit_code != 1 or not failures:
        return False
    return all(any(f.startswith(f"agent {n} exited with ") for n in ended) for f in failures)
