"""Running a scenario: the fault-free reference once, then each run of the schedule.

Where it sits: `keepstep chaos run` (chaos/cli.py) calls `run_scenario`; it expands the
schedule (`schedule.py`), gets the reference run from the cache or runs it, runs every
`RunPlan` on the target, checks each run (`invariants.py`) and returns the result that
`report.py` writes. The reference is cached under a hash of everything that decides its
numbers (the job, the training script, the elastic library's sources), so the scenarios
of one job share one fault-free run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.recovery import recoveries
from keepstep.chaos.invariants import (
    Observation,
    Reference,
    Verdict,
    check,
    explaining,
    reference_from,
)
from keepstep.chaos.model import Job, Scenario
from keepstep.chaos.schedule import RunPlan, expand
from keepstep.chaos.tally import by_kind, unexplained
from keepstep.chaos.target import RunOutcome, Target
from keepstep.errors import KeepstepError
from keepstep.launch.summary import fault_step_error, injected_faults

_REFERENCE_FORMAT = 3  # bump when `Reference` changes: old cache entries are not read


class ChaosError(KeepstepError):
    """The harness itself could not do its work (not a violated invariant)."""


@dataclass
class RunResult:
    plan: RunPlan
    outcome: RunOutcome
    verdict: Verdict


@dataclass
class ScenarioResult:
    scenario: Scenario
    target: str
    reference: Reference | None
    runs: list[RunResult] = field(default_factory=list)
    skipped: str | None = None
    reference_path: Path | None = None

    @property
    def passed(self) -> bool:
        # Not only the invariants: a harness failure (the injector died) fails a run too.
        return self.skipped is None and all(not r.verdict.violations for r in self.runs)


def job_key(job: Job) -> str:
    """A hash of what decides the fault-free run's numbers."""
    fields = asdict(job)
    del fields["timeout"]  # how long to wait changes no number
    del fields["etcd_members"]  # nor how many etcd members the run has
    del fields["shard"]  # nor sharding the optimizer state: the reference has full replicas
    fields["reference_format"] = _REFERENCE_FORMAT
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    try:
        h.update(Path(job.script).read_bytes())
    except OSError as error:
        raise ChaosError(f"training script {job.script!r}: {error.strerror}") from None
    # The library decides the numbers too; found without importing it (that imports torch).
    spec = importlib.util.find_spec("keepstep.elastic")
    assert spec is not None and spec.submodule_search_locations, "keepstep.elastic is a package"
    library = Path(next(iter(spec.submodule_search_locations)))
    for path in sorted(library.rglob("*.py")):
        h.update(str(path.relative_to(library)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


def reference(
    job: Job, target: Target, cache: Path, say: Callable[[str], None] = print
) -> Reference:
    """The fault-free run of `job` with full replicas (sharded or not, a run must end with
    their numbers): from the cache, or run now and cached."""
    job = replace(job, shard=None)
    key = job_key(job)
    path = cache / f"reference-{key}.json"
    if path.exists():
        return load_reference(path)
    say(f"reference: fault-free run of the job ({job.steps} steps, {job.nodes} nodes)")
    outcome = target.run(job, None, cache / f"reference-{key}")
    if outcome.summary is None:
        raise ChaosError(
            f"the fault-free reference run failed (see {outcome.run_dir}):\n{outcome.output_tail}"
        )
    try:
        ref = reference_from(outcome.summary, outcome.events, job, outcome.seen.checkpoints)
    except ValueError as error:
        raise ChaosError(f"{error} (see {outcome.run_dir})") from None
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(ref)))
    return ref


def load_reference(path: Path) -> Reference:
    data = json.loads(path.read_text())
    data["micro_batch_samples"] = tuple(tuple(row) for row in data["micro_batch_samples"])
    data["checkpoints"] = tuple((int(step), str(sha)) for step, sha in data["checkpoints"])
    return Reference(**data)


def run_scenario(
    scenario: Scenario,
    target: Target,
    out_dir: Path,
    cache: Path | None = None,
    only_runs: set[int] | None = None,
    say: Callable[[str], None] = print,
    reference_target: Target | None = None,
) -> ScenarioResult:
    """Run every plan of the scenario on `target`. The fault-free reference runs on
    `reference_target` (default: `target`): a cluster target compares with the same job
    run locally, whose numbers are the same by design and which is cached."""
    plans = expand(scenario)
    if only_runs is not None:
        plans = [p for p in plans if p.index in only_runs]
    unsupported = target.unsupported()
    kinds = {f.kind for p in plans for f in p.faults}
    if kinds and kinds <= set(unsupported):
        reason = "; ".join(unsupported[k] for k in sorted(kinds, key=lambda k: k.value))
        return ScenarioResult(scenario, target.name, None, skipped=reason)
    ref = reference(scenario.job, reference_target or target, cache or out_dir, say)
    ref_path = (cache or out_dir) / f"reference-{job_key(scenario.job)}.json"
    result = ScenarioResult(scenario, target.name, ref, reference_path=ref_path)
    for plan in plans:
        say(f"run {plan.index + 1}/{scenario.runs}: {', '.join(map(str, plan.faults))}")
        outcome = target.run(scenario.job, plan, out_dir / f"run-{plan.index:03d}")
        verdict = check(
            outcome.summary,
            outcome.events,
            ref,
            outcome.seen,
            scenario.job,
            scenario.checks,
        )
        if outcome.injector_error is not None:
            verdict.violations.append(f"harness: the injector failed: {outcome.injector_error}")
        result.runs.append(RunResult(plan, outcome, verdict))
        applied = sum(1 for f in outcome.seen.faults if f.get("t") is not None)
        ratio = verdict.goodput.get("ratio")
        say(
            f"  {applied}/{len(plan.faults)} faults applied; "
            + (f"VIOLATED: {verdict.violations}" if verdict.violations else "invariants hold")
            + (f"; goodput {ratio:.3f} of the fault-free run" if ratio else "")
        )
    return result


def summarize(result: ScenarioResult) -> dict[str, Any]:
    """The report's JSON: invariants over all runs, violations, faults, recoveries, goodput."""
    s = result.scenario
    faults, recoveries, runs = [], [], []
    samples = seconds = 0.0
    for r in result.runs:
        start = r.outcome.started_t
        for f in r.outcome.seen.faults:
            t = f.get("t")
            faults.append({"run": r.plan.index, **f, "t_s": t - start if t else None})
        for rec in attribute(r.outcome):
            recoveries.append({"run": r.plan.index, **rec})
        rate = r.verdict.goodput.get("samples_per_s")
        if rate:
            samples += s.job.steps * s.job.global_batch
            seconds += s.job.steps * s.job.global_batch / rate
        runs.append(
            {
                "index": r.plan.index,
                "seed": r.plan.seed,
                "run_dir": str(r.outcome.run_dir),
                "faults": [str(f) for f in r.plan.faults],
                "invariants": r.verdict.invariants,
                "violations": r.verdict.violations,
                "goodput": r.verdict.goodput,
                "exit_code": r.outcome.seen.exit_code,
                "started_t": start,
                "ended_t": r.outcome.seen.ended_t,
                "wall_s": r.outcome.seen.ended_t - start,
                "leftovers": list(r.outcome.seen.leftovers),
                "checkpoints": [list(c) for c in r.outcome.seen.checkpoints],
                "injector_error": r.outcome.injector_error,
            }
        )
    ref_rate = result.reference.samples_per_s if result.reference else None
    rate = samples / seconds if seconds else None
    return {
        "scenario": s.name,
        "description": s.description,
        "source": s.source,
        "target": result.target,
        "seed": s.seed,
        "passed": result.passed,
        "skipped": result.skipped,
        "known_failure": s.known_failure,
        **_judged((r.plan.index, r.verdict) for r in result.runs),
        "faults": faults,
        "faults_applied": sum(1 for f in faults if f.get("t") is not None),
        "faults_skipped": sum(1 for f in faults if f.get("skipped")),
        # Steps late of the latest step fault (0: each landed at its step; None: none).
        "fault_step_error_max": fault_step_error(faults),
        "recoveries": recoveries,
        # Recoveries with no fault and no planned change behind them: false detections.
        "unexplained_recoveries": unexplained(recoveries),
        "by_kind": by_kind(
            {r.plan.index: r.plan.faults for r in result.runs}, s.job, faults, recoveries
        ),
        "goodput": {
            "samples_per_s": rate,
            "reference_samples_per_s": ref_rate,
            "ratio": rate / ref_rate if rate and ref_rate else None,
            "target": s.checks.min_goodput,
        },
        "reference_path": str(result.reference_path) if result.reference_path else None,
        "reference": asdict(result.reference)
        | {"micro_batch_samples": "(per step digests)", "checkpoints": "(see the cache)"}
        if result.reference
        else None,
        "runs": runs,
    }


def attribute(outcome: RunOutcome) -> list[dict[str, Any]]:
    """The summary's recoveries, each with the fault it followed (`fault`: its index in the
    run's list) and, timed from that fault's injection, `detect_from_fault_s` and
    `mttr_from_fault_s`; and `absorbed`, the faults whose effect came inside the same
    recovery (each `fault` with its `mttr_from_fault_s`). The summary can only time the
    faults the launcher injected; these are the same fold (`protocol.recovery`) given
    every fault the run applied that changes the membership, so they time the injector's
    faults too."""
    applied = explaining(outcome.seen.faults)
    injected = injected_faults(applied)
    folded = {r.epoch: r for r in recoveries(outcome.events, injected)}
    out = []
    for rec in (outcome.summary or {}).get("recoveries", []):
        rec = dict(rec)
        r = folded.get(int(rec["epoch"]))
        if r is not None and r.fault is not None:
            rec["fault"] = applied[r.fault]["index"]
            rec["detect_from_fault_s"] = r.detect_s
            rec["mttr_from_fault_s"] = r.mttr_s
        if r is not None and r.absorbed:
            rec["absorbed"] = [
                {
                    "fault": applied[i]["index"],
                    "mttr_from_fault_s": None if r.end_t is None else r.end_t - injected[i].t,
                }
                for i in r.absorbed
            ]
        out.append(rec)
    return out


def recheck(data: dict[str, Any], scenario: Scenario) -> list[Verdict]:
    """Judge the runs of a report again from their run directories (after the invariants
    changed, or to look at a run again): nothing is run."""
    ref = load_reference(Path(data["reference_path"]))
    verdicts = []
    for run in data["runs"]:
        outcome = _outcome(data, run)
        verdict = check(
            outcome.summary, outcome.events, ref, outcome.seen, scenario.job, scenario.checks
        )
        if run.get("injector_error"):
            verdict.violations.append(f"harness: the injector failed: {run['injector_error']}")
        verdicts.append(verdict)
    return verdicts


def _judged(verdicts: Iterable[tuple[int, Verdict]]) -> dict[str, Any]:
    """The report's verdict over its runs (index, verdict): each invariant held in every
    run, and every violation named by its run."""
    invariants: dict[str, bool] = {}
    violations: list[str] = []
    for index, verdict in verdicts:
        for name, ok in verdict.invariants.items():
            invariants[name] = invariants.get(name, True) and ok
        violations += [f"run {index}: {v}" for v in verdict.violations]
    return {"invariants": invariants, "violations": violations}


def rejudged(data: dict[str, Any], verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """The report with the verdicts `recheck` found now, one per run, in place of its own
    (its `passed` too: a run skipped stays failed)."""
    runs = [
        run | {"invariants": v.invariants, "violations": v.violations}
        for run, v in zip(data["runs"], verdicts, strict=True)
    ]
    judged = _judged((run["index"], v) for run, v in zip(runs, verdicts, strict=True))
    passed = data.get("skipped") is None and not judged["violations"]
    return data | judged | {"runs": runs, "passed": passed}


def refold(data: dict[str, Any], scenario: Scenario) -> dict[str, Any]:
    """The report with its recoveries folded again from the runs' event logs, attributed
    to the faults, and tallied by kind (after the fold changed): nothing is run."""
    recovered = [
        {"run": run["index"], **rec}
        for run in data["runs"]
        for rec in attribute(_outcome(data, run))
    ]
    plans = {p.index: p.faults for p in expand(scenario)}
    return data | {
        "recoveries": recovered,
        "unexplained_recoveries": unexplained(recovered),
        "by_kind": by_kind(plans, scenario.job, data["faults"], recovered),
    }


def _outcome(data: dict[str, Any], run: dict[str, Any]) -> RunOutcome:
    """One run of a report as it was seen, read back from its run directory."""
    run_dir = Path(run["run_dir"])
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    faults = tuple(
        {k: v for k, v in f.items() if k not in ("run", "t_s")}
        for f in data["faults"]
        if f["run"] == run["index"]
    )
    seen = Observation(
        run["exit_code"],
        run["ended_t"],
        faults,
        tuple(run["leftovers"]),
        tuple((int(step), str(sha)) for step, sha in run.get("checkpoints", [])),
    )
    return RunOutcome(run_dir, summary, read_events(run_dir), seen, run["started_t"])
