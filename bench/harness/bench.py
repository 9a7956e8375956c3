"""The whole benchmark: plan the runs, run them interleaved, compute every figure, one report.

    plan_runs(cfg) -> [Planned]          rounds of every system, the order rotated each round
    execute(cfg, workdir, say) -> [Done] make the runs (each keeps result.json in its folder)
    load_results(cfg, workdir) -> [Done] the same, read back from a kept workdir
    analyze(cfg, done) -> dict           every figure, the ratios and targets: the report

Every system gets the same workload and the same seeded fault schedule. DDP runs without
faults: it is the speed reference and, being the same script without checkpoints,
torchrun's fault-free reference for the deviation figures; keepstep and TorchFT have
fault-free runs of their own. A run that fails is recorded with its error and the rest
goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import figures as fig
from harness.assemble import step_time_ratio_by_round, system_figures, targets
from harness.config import BenchConfig, System
from harness.ledger import Ledger, build_ledger
from harness.run_ddp import run_ddp
from harness.run_keepstep import run_keepstep
from harness.run_torchft import run_torchft
from harness.run_torchrun import run_torchrun
from harness.runs import Done, Planned, Run, RunResult
from harness.schedule import make_schedule
from harness.steplog import read_records

RECOVERY_KEYS = (
    "cause",
    "node",
    "step",
    "mttr_s",
    "detect_s",
    "agree_s",
    "communicator_s",
    "restore_s",
)
RUNNERS: dict[System, Callable[[Run], RunResult]] = {
    System.DDP: run_ddp,
    System.KEEPSTEP: run_keepstep,
    System.TORCHRUN: run_torchrun,
    System.TORCHFT: run_torchft,
}


def plan_runs(cfg: BenchConfig) -> list[Planned]:
    """Round r runs every system once (faulty and fault-free back to back, alternating
    which first), starting one system later than round r-1."""
    systems = list(cfg.systems)
    out = []
    for rep in range(cfg.repeats):
        k = rep % len(systems)
        for system in systems[k:] + systems[:k]:
            if system is System.DDP:
                variants = [False]
            elif system is System.TORCHRUN:
                variants = [True]  # its fault-free twin is the DDP run
            else:
                variants = [False, True] if rep % 2 == 0 else [True, False]
            out += [Planned(system, v, rep) for v in variants]
    return out


def _ledger(cfg: BenchConfig, result: RunResult) -> Ledger:
    w = cfg.workload
    last = [
        float(r["t"]) for r in result.records if r["kind"] == "commit" and r["step"] == w.steps - 1
    ]
    # Lines after the job's last step (a replacement that came up too late and trained on
    # its own) are not part of the run.
    end_t = min(last) + 1.0 if last else None
    return build_ledger(result.records, w.steps, w.n_micro, w.micro_batch, end_t)


def _line(done: Done, cfg: BenchConfig) -> str:
    r, led = done.result, done.ledger
    steps = len(led.entries)
    text = f"{done.planned.label:<24} {r.wall_s:6.1f} s  steps {steps}/{cfg.workload.steps}"
    text += f"  lost {led.lost}  duplicated {led.duplicated}"
    outcomes = fig.fault_outcomes(led, r.faults, cfg.nodes, None)
    for o in outcomes:
        if "mttr_s" in o:
            text += f"  {o['kind']} {o['mttr_s']:.2f} s" if o["mttr_s"] is not None else ""
    if r.error:
        text += f"  ERROR: {r.error.splitlines()[0][:160]}"
    return text


def execute(cfg: BenchConfig, workdir: Path, say: Callable[[str], None]) -> list[Done]:
    """Make every planned run, in order; each run's result is kept in its folder."""
    w = cfg.workload
    schedule = make_schedule(cfg.schedule_seed, w.steps, cfg.nodes, cfg.warmup_steps)
    planned = plan_runs(cfg)
    say(
        f"{len(planned)} runs: {w.steps} steps, global batch {w.global_batch} "
        f"({w.n_micro} x {w.micro_batch}), {cfg.nodes} nodes; faults "
        + ", ".join(f.spec() for f in schedule)
    )
    done: list[Done] = []
    for i, p in enumerate(planned):
        folder = (
            workdir / f"{i:02d}-{p.system.value}-{'faults' if p.faulty else 'clean'}-{p.repeat}"
        )
        result = RUNNERS[p.system](Run(p.system, cfg, schedule if p.faulty else (), folder))
        save_result(folder, p, result)
        d = Done(p, result, _ledger(cfg, result))
        done.append(d)
        say(f"[{i + 1}/{len(planned)}] " + _line(d, cfg))
    return done


def save_result(folder: Path, p: Planned, r: RunResult) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "system": p.system.value,
        "faulty": p.faulty,
        "repeat": p.repeat,
        "wall_s": r.wall_s,
        "error": r.error,
        "faults": r.faults,
        "params": str(r.params) if r.params else None,
        "extra": r.extra,
    }
    (folder / "result.json").write_text(json.dumps(record, indent=2))


def load_results(cfg: BenchConfig, workdir: Path) -> list[Done]:
    """The runs of an earlier invocation kept with --workdir, in the order they ran."""
    done = []
    for path in sorted(workdir.glob("*/result.json")):
        record = json.loads(path.read_text())
        system = System(record["system"])
        steps = path.parent / "steps"
        result = RunResult(
            system,
            faulty=record["faulty"],
            wall_s=record["wall_s"],
            error=record["error"],
            records=read_records(steps) if steps.is_dir() else [],
            faults=record["faults"],
            params=Path(record["params"]) if record["params"] else None,
            extra=record["extra"],
        )
        p = Planned(system, record["faulty"], record["repeat"])
        done.append(Done(p, result, _ledger(cfg, result)))
    return done


def analyze(cfg: BenchConfig, done: list[Done]) -> dict[str, Any]:
    """Every figure of every system, the ratios and the targets, from the finished runs."""
    w = cfg.workload
    schedule = make_schedule(cfg.schedule_seed, w.steps, cfg.nodes, cfg.warmup_steps)
    ddp = [d for d in done if d.planned.system is System.DDP]
    systems: dict[str, dict[str, Any]] = {}
    for system in cfg.systems:
        mine = [d for d in done if d.planned.system is system]
        systems[system.value] = system_figures(cfg, system, mine, ddp)
    ddp_rate = systems[System.DDP.value]["samples_per_s"]
    for f in systems.values():
        f["goodput_vs_ddp"] = fig.div(f["goodput_samples_per_s"], ddp_rate)
    ks = [d for d in done if d.planned.system is System.KEEPSTEP]
    if ks:
        shas = {d.planned.label: d.result.extra.get("summary", {}).get("params_sha256") for d in ks}
        systems[System.KEEPSTEP.value]["summary_params_sha256"] = shas
        systems[System.KEEPSTEP.value]["summary_recoveries"] = [
            {k: r.get(k) for k in RECOVERY_KEYS}
            for d in ks
            for r in d.result.extra.get("summary", {}).get("recoveries", [])
        ]
    ft = [d for d in done if d.planned.system is System.TORCHFT]
    if ft:
        systems[System.TORCHFT.value]["settings"] = {
            "lighthouse": ft[0].result.extra.get("lighthouse"),
            "data": ft[0].result.extra.get("data_mode"),
            "grad_sync": ft[0].result.extra.get("grad_sync"),
            "ddp_wrapper_failure": ft[0].result.extra.get("ddp_wrapper_failure"),
        }
    return {
        "config": cfg.as_json(),
        "schedule": [f.as_json() | {"spec": f.spec()} for f in schedule],
        "runs": [d.planned.label for d in done],
        "systems": systems,
        "ratios": fig.ratios(systems),
        "targets": targets(systems, step_time_ratio_by_round(cfg, done)),
    }
