"""Time to recover, per fault kind: keepstep's MTTR and its phases, with the numbers checked.

    scripts/env python bench/mttr.py [--faults-per-kind 20]
        [--kinds kill-worker,kill-node,hang-node,drain-node] [--shard zero1|zero2] [--json PATH]
        [--nodes 4] [--script examples/mlp.py] [--script-args "..."]

For each kind it runs `keepstep run` (--nodes, 4 by default; --script, examples/mlp.py by
default, with a small --sleep so a step takes ~0.1 s) with several faults of that kind per
run, until at least N were measured. Every node loss (kill, hang, drain) is followed by a
`join-node`, so the job keeps --nodes or one fewer (a joiner needs ~5 s to start python
and torch and be admitted, hence the spacing); a killed worker is restarted by its agent and
rejoins by itself, and each worker is killed at most `WORKER_RESTARTS` times per run.

--sleep is examples/mlp.py's own flag, so only that script gets it; any other script gets
just --script-args (split as a shell would) after the job's numbers, which `keepstep run`
passes in the environment. Node losses hit n1, n2, ... in turn, then the joined nodes, so
a joined node is hit nodes-1 node spacings after it joined: with --nodes 2 one spacing
must be long enough for a joiner to be admitted (raise --node-spacing for fast steps). On
2 nodes a node loss leaves one node until the join: `--min-nodes` only gates the first
epoch, and after it the job trains on whatever nodes survive.

The join is scheduled at the same step as its loss, right after it, so it can never be
taken for the cause of that loss's epoch or of the next one, whenever it is admitted (its
admission is a record of its own, reason "admit ...").

Each run is checked against a fault-free run of the same job (same nodes, batch split,
steps, seed; run once, without --sleep, which only waits and never touches the numbers):
the final params_sha256 must be equal and no sample may be lost or duplicated. Prints, per
kind, the count, MTTR p50/p95 and the p50 of each phase and of the rolled-back steps.
With --shard every run (the fault-free one too) shards its optimizer state
(`keepstep run --shard`): the same table, to set beside a run without it.
bench/torchrun_baseline.py calls `measure` for its keepstep figure.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from harness.stats import percentile  # noqa: E402

KINDS = ("kill-worker", "kill-node", "hang-node", "drain-node")
MLP = REPO / "examples" / "mlp.py"  # the default script, the only one with --sleep
PHASES = ("detect_s", "agree_s", "communicator_s", "restore_s", "replan_s")


# An agent restarts a crashed worker at most AgentConfig.max_restarts times in a row
# (`keepstep run` has no flag for it); each worker is killed at most this often per run,
# with time to rejoin in between, so no worker is ever given up.
WORKER_RESTARTS = 3


@dataclass(frozen=True)
class Settings:
    """One benchmark job and its fault schedule. Steps are counted in committed steps."""

    nodes: int = 4
    global_batch: int = 96
    micro_batch: int = 4
    seed: int = 0
    min_nodes: int = 2
    sleep: float = 0.01
    node_spacing: int = 55  # steps between node losses: ~6 s, about what a joiner needs
    worker_spacing: int = 25
    join_after: int = 0
    first_step: int = 10
    faults_per_run: int = 11  # node losses per run (each brings a join)
    tail_steps: int = 20
    run_timeout: float = 300.0
    shard: str | None = None  # `keepstep run --shard`: None keeps full replicas
    script: str = str(MLP)  # the training script (a str, so the settings dump to JSON)
    script_args: tuple[str, ...] = ()  # passed to the script after the job's own flags

    @property
    def takes_sleep(self) -> bool:
        """--sleep is examples/mlp.py's flag: another script would reject it."""
        return Path(self.script).resolve() == MLP

    def script_argv(self, sleep: float | None = None) -> list[str]:
        """The script and its arguments, as the tail of `keepstep run`'s command line."""
        argv = [self.script, *self.script_args]
        if self.takes_sleep:
            argv += ["--sleep", str(self.sleep if sleep is None else sleep)]
        return argv

    def __post_init__(self) -> None:
        if self.nodes < 2:  # a node loss must leave one to train on
            raise ValueError(f"--nodes {self.nodes} must be >= 2")
        if not Path(self.script).is_file():
            raise ValueError(f"--script {self.script}: no such file")
        n_micro, rest = divmod(self.global_batch, self.micro_batch)
        if self.micro_batch < 1 or rest:
            raise ValueError(
                f"--global-batch {self.global_batch} must be a multiple of --micro-batch "
                f"{self.micro_batch} (>= 1)"
            )
        if self.faults_per_run < 1 or self.nodes + self.faults_per_run > n_micro:
            raise ValueError(
                f"{self.nodes} nodes + {self.faults_per_run} joins need as many micro-batches; "
                f"--global-batch {self.global_batch} / --micro-batch {self.micro_batch} gives "
                f"{n_micro}: --faults-per-run must be 1..{n_micro - self.nodes}"
            )
        if not 0 <= self.join_after < self.node_spacing:
            raise ValueError(
                f"--join-after {self.join_after} must be >= 0 and below --node-spacing "
                f"{self.node_spacing}"
            )
        if self.worker_spacing < 1:
            raise ValueError(f"--worker-spacing {self.worker_spacing} must be >= 1")
        if not 2 <= self.min_nodes <= self.nodes:
            raise ValueError(f"--min-nodes {self.min_nodes} must be between 2 and --nodes")

    def per_run(self, kind: str, count: int) -> int:
        """Faults of `kind` in one run when `count` are still wanted."""
        cap = self.nodes * WORKER_RESTARTS if kind == "kill-worker" else self.faults_per_run
        return max(1, min(cap, count))

    def steps(self, kind: str, count: int) -> int:
        spacing = self.worker_spacing if kind == "kill-worker" else self.node_spacing
        return self.first_step + self.per_run(kind, count) * spacing + self.tail_steps


def fault_schedule(kind: str, count: int, s: Settings) -> list[str]:
    """`count` faults of `kind` as `keepstep run --fault` specs.

    Node losses take the original nodes but n0 and then the joined ones in turn (on 4
    nodes: n1, n2, n3, n4, ...; each joined nodes-1 spacings before it is hit); worker
    kills go round the original nodes.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: allowed are {', '.join(KINDS)}")
    specs = []
    for k in range(count):
        if kind == "kill-worker":
            specs.append(
                f"kill-worker:{(k + 1) % s.nodes}@step={s.first_step + k * s.worker_spacing}"
            )
        else:
            step = s.first_step + k * s.node_spacing
            # Listed after the loss: at one step the launcher injects in this order.
            specs.append(f"{kind}:{k + 1}@step={step}")
            specs.append(f"join-node@step={step + s.join_after}")
    return specs


def run_keepstep(
    s: Settings, steps: int, faults: Sequence[str], run_dir: Path, sleep: float | None = None
) -> dict[str, Any]:
    """One `keepstep run`; returns its summary.json plus the exit code and the log tail."""
    argv = [
        sys.executable, "-m", "keepstep", "run",
        "--nodes", str(s.nodes), "--min-nodes", str(s.min_nodes),
        "--global-batch", str(s.global_batch), "--micro-batch", str(s.micro_batch),
        "--steps", str(steps), "--seed", str(s.seed), "--run-dir", str(run_dir),
        "--timeout", str(s.run_timeout),
    ]  # fmt: skip
    if s.shard:
        argv += ["--shard", s.shard]
    for spec in faults:
        argv += ["--fault", spec]
    argv += s.script_argv(sleep)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "wb") as out:
        proc = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, timeout=s.run_timeout + 60, check=False
        )
    path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    summary["returncode"] = proc.returncode
    summary["log_tail"] = log.read_text(errors="replace")[-1500:]
    return summary


@dataclass
class KindResult:
    kind: str
    records: list[dict[str, Any]] = field(default_factory=list)
    injected: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        mttr = [r["mttr_s"] for r in self.records]
        return {
            "count": len(self.records),
            "injected": self.injected,
            "mttr_p50_s": percentile(mttr, 0.5),
            "mttr_p95_s": percentile(mttr, 0.95),
            "mttr_max_s": max(mttr, default=None),
            "phase_p50_s": {p: percentile([r[p] for r in self.records], 0.5) for p in PHASES},
            "rolled_back_steps_p50": percentile(
                [float(r["rolled_back_steps"]) for r in self.records], 0.5
            ),
        }


def check_run(summary: dict[str, Any], reference: str | None, steps: int) -> list[str]:
    """What is wrong with one run: unfinished, other numbers, lost or repeated samples."""
    problems = []
    if summary.get("returncode") != 0 or summary.get("steps") != steps:
        problems.append(
            f"exit code {summary.get('returncode')}, {summary.get('steps')}/{steps} steps"
        )
    sha = summary.get("params_sha256")
    if reference is not None and sha != reference:
        problems.append(f"params_sha256 {sha} != fault-free {reference}")
    samples = summary.get("samples", {})
    if samples.get("lost", 1) or samples.get("duplicated", 1):
        problems.append(
            f"samples lost {samples.get('lost')}, duplicated {samples.get('duplicated')}"
        )
    if samples.get("plan_mismatches"):
        problems.append(f"plan mismatches: {samples['plan_mismatches'][:3]}")
    return problems


def reference_sha(s: Settings, steps: int, workdir: Path) -> str:
    """params_sha256 of the fault-free run of this job (sleep 0: same numbers, faster)."""
    summary = run_keepstep(s, steps, [], workdir / f"fault-free-{steps}", sleep=0.0)
    problems = check_run(summary, None, steps)
    if problems or not summary.get("params_sha256"):
        raise SystemExit(f"fault-free run failed: {problems}\n{summary.get('log_tail')}")
    return str(summary["params_sha256"])


def measure_kind(
    kind: str, count: int, s: Settings, workdir: Path, reference: str, max_runs: int
) -> tuple[KindResult, list[str]]:
    """Runs until `count` faults of `kind` have a recovery record (or `max_runs` ran)."""
    result, violations = KindResult(kind), []
    steps, faults = s.steps(kind, count), fault_schedule(kind, s.per_run(kind, count), s)
    for run in range(max_runs):
        if len(result.records) >= count:
            break
        t0 = time.monotonic()
        summary = run_keepstep(s, steps, faults, workdir / f"{kind}-{run}")
        recoveries = summary.get("recoveries", [])
        mine = [r for r in recoveries if r["cause"] == kind and r["mttr_s"] is not None]
        # Epochs neither caused by a fault of this kind nor admitting a joiner: a stall
        # or a second failure inside one recovery.
        extra = [
            r for r in recoveries if r["cause"] != kind and not r["reason"].startswith("admit")
        ]
        injected = sum(1 for f in summary.get("faults", []) if f["kind"] == kind)
        result.records += mine
        result.injected += injected
        world = [w for w in summary.get("world_size_by_step", []) if w]
        problems = check_run(summary, reference, steps)
        sha = summary.get("params_sha256")
        if len(mine) != injected:
            problems.append(f"{injected} {kind} faults injected, {len(mine)} recovery records")
        violations += [f"{kind} run {run}: {p}" for p in problems]
        result.runs.append(
            {
                "run": run,
                "steps": steps,
                "seconds": round(time.monotonic() - t0, 1),
                "injected": injected,
                "measured": len(mine),
                "world_min": min(world, default=0),
                "world_max": max(world, default=0),
                "extra_epochs": extra,
                "admissions": sum(1 for r in recoveries if r["reason"].startswith("admit")),
                "params_sha256": sha,
                "params_match": sha is not None and sha == reference,
                "problems": problems,
            }
        )
        slow = max((r["mttr_s"] for r in mine), default=0.0)
        print(
            f"  {kind} run {run}: {len(mine)}/{injected} measured, world "
            f"{min(world, default=0)}-{max(world, default=0)}, slowest {slow:.2f} s, "
            f"{len(extra)} extra epochs, {time.monotonic() - t0:.0f} s"
            + ("  " + "; ".join(problems) if problems else ""),
            flush=True,
        )
    if len(result.records) < count:
        violations.append(f"{kind}: only {len(result.records)} of {count} faults measured")
    return result, violations


def measure(
    kinds: Sequence[str], count: int, s: Settings, workdir: Path, max_runs: int | None = None
) -> dict[str, Any]:
    """Per kind: the fault-free reference of its run length (once), then faulty runs."""
    t0 = time.monotonic()
    out: dict[str, Any] = {
        "settings": asdict(s),
        "faults_per_kind": count,
        "reference_params_sha256": {},
        "kinds": {},
        "violations": [],
    }
    references: dict[int, str] = out["reference_params_sha256"]
    for kind in kinds:
        steps = s.steps(kind, count)
        if steps not in references:
            t = time.monotonic()
            references[steps] = reference_sha(s, steps, workdir)
            print(
                f"fault-free run, {steps} steps: params_sha256 {references[steps]} "
                f"({time.monotonic() - t:.0f} s)",
                flush=True,
            )
        runs = max_runs or math.ceil(count / s.per_run(kind, count)) + 2
        result, violations = measure_kind(kind, count, s, workdir, references[steps], runs)
        out["kinds"][kind] = {**result.figures(), "runs": result.runs, "records": result.records}
        out["violations"] += violations
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value * 1000:6.0f}"


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{'kind':<12} {'n':>3}  {'MTTR p50':>8} {'p95':>6} (ms) | p50 ms: {'detect':>6} "
        f"{'agree':>6} {'comm':>6} {'restore':>7} {'replan':>6} | rolled back p50"
    )
    for kind, f in report["kinds"].items():
        p = f["phase_p50_s"]
        rolled = f["rolled_back_steps_p50"]
        print(
            f"{kind:<12} {f['count']:>3}  {_ms(f['mttr_p50_s']):>8} {_ms(f['mttr_p95_s'])}"
            f"      |         {_ms(p['detect_s'])} {_ms(p['agree_s'])} "
            f"{_ms(p['communicator_s'])} {_ms(p['restore_s']):>7} {_ms(p['replan_s'])} | "
            f"{'-' if rolled is None else f'{rolled:g}'}"
        )
    if report["violations"]:
        print("\nVIOLATIONS:")
        for v in report["violations"]:
            print(f"  {v}")
    else:
        print(
            "\nevery run: params_sha256 equal to the fault-free run, 0 samples lost, 0 duplicated"
        )


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--sleep", type=float, default=d.sleep, help="s per micro-batch")
    parser.add_argument("--global-batch", type=int, default=d.global_batch)
    parser.add_argument("--micro-batch", type=int, default=d.micro_batch)
    parser.add_argument("--faults-per-run", type=int, default=d.faults_per_run)
    parser.add_argument("--node-spacing", type=int, default=d.node_spacing, help="steps")
    parser.add_argument("--worker-spacing", type=int, default=d.worker_spacing, help="steps")
    parser.add_argument("--join-after", type=int, default=d.join_after, help="steps")
    parser.add_argument("--workdir", help="keep run directories here (default: a temp dir)")
    parser.add_argument("--shard", choices=["zero1", "zero2"], help="shard the optimizer state")


def script_path(value: str) -> str:
    """--script: a file, as given or relative to the repository (an argparse type)."""
    for path in (Path(value), REPO / value):
        if path.is_file():
            return str(path.resolve())
    raise argparse.ArgumentTypeError(f"{value!r}: no such file (nor under {REPO})")


def node_count(value: str) -> int:
    """--nodes: an int >= 2, since a node loss must leave a node (an argparse type)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"{n}: nodes must be >= 2")
    return n


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """The job's shape: node count and training script. Apart from add_settings_args,
    which bench/torchrun_baseline.py shares with a torchrun job of its own fixed shape."""
    d = Settings()
    parser.add_argument("--nodes", type=node_count, default=d.nodes, help="nodes at start")
    parser.add_argument("--script", type=script_path, default=d.script, help="training script")
    parser.add_argument(
        "--script-args",
        type=shlex.split,
        default=list(d.script_args),
        help="the script's own arguments, one string split as a shell would: "
        '--script-args "--layers 2" (a lone flag: --script-args=--flag)',
    )


def settings_from(args: argparse.Namespace) -> Settings:
    d = Settings()
    return replace(
        d,
        # The job's shape, where the parser has add_job_args; else the default job.
        nodes=getattr(args, "nodes", d.nodes),
        script=getattr(args, "script", d.script),
        script_args=tuple(getattr(args, "script_args", d.script_args)),
        sleep=args.sleep,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        faults_per_run=args.faults_per_run,
        node_spacing=args.node_spacing,
        worker_spacing=args.worker_spacing,
        join_after=args.join_after,
        shard=args.shard,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults-per-kind", type=int, default=20)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--json", help="also write every figure and record here")
    add_job_args(parser)
    add_settings_args(parser)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds {unknown}: allowed are {', '.join(KINDS)}")
    try:
        s = settings_from(args)
    except ValueError as error:
        parser.error(str(error))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-mttr-"))
    try:
        report = measure(kinds, args.faults_per_kind, s, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(report)
    print(f"({report['seconds']:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
