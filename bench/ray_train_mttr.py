"""Ray Train's restart-from-checkpoint MTTR beside keepstep's, for the same job, in one run.

    scripts/env python bench/ray_train_mttr.py [--faults 2] [--health-check-interval 2]
        [--json PATH]

Trains examples/mlp.py's job (model, data, keyed samples, global batch 96 in micro-batches
of 4, --sleep per micro-batch, as bench/torchrun_job.py computes it: DDP over gloo,
micro-batch i on rank i % 4) as a Ray Train `TorchTrainer` with 4 workers on a local Ray
cluster this script starts (`ray.cluster_utils.Cluster`, 4 CPUs) and stops at the end,
checking that no process of it is left. Fault tolerance is Ray Train's own: after every
step (as the torchrun baseline) rank 0 reports model and optimizer as a `Checkpoint`,
every start resumes from `ray.train.get_checkpoint()`, and
`FailureConfig(max_failures=FAULTS)` lets the controller replace the whole worker group
when a worker dies.

At steps 10, 10 + spacing, ... one worker process (rank k+1 of the k-th kill) gets SIGKILL;
MTTR is, as for torchrun, kill -> the first step committed (its checkpoint reported) by
the restarted group, with its parts `restart` (-> the train function runs again on every
new worker: Ray noticed the death at its next health check, tore the group down, started
new actors and their process group), `restore` (-> every worker loaded the checkpoint) and
`first step`. Steps lost = the last step committed before the kill minus the step the
restarted group resumed from (a checkpoint persisted but not yet registered by the
controller is not restored). Ray Train takes one report per worker per health check
(`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`, Ray's default 2 s; `--health-check-interval` sets
it), so a report every step also bounds the step time: the steady step time is printed.

Then, in the same invocation, keepstep's kill-worker MTTR for the same job through
bench/mttr.py (4 nodes, same batch split and --sleep; a fault-free reference run, then the
same number of kills) and the ratio Ray Train / keepstep of the MTTR p50s.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mttr
from harness.procs import RunFailed, descendants, wait_for
from harness.stats import percentile
from torchrun_baseline import figures, read_log

REPO = Path(__file__).resolve().parents[1]
WORKERS = 4
PHASES = ("restart_s", "restore_s", "first_step_s")


@dataclass(frozen=True)
class RayTrainJob:
    """The Ray Train side: job size (shared with keepstep's) and its kill schedule."""

    global_batch: int
    micro_batch: int
    sleep: float
    faults: int = 2
    spacing: int = 10  # committed steps between kills
    first_step: int = 10
    tail_steps: int = 5
    health_check_interval: float = 2.0
    step_timeout: float = 180.0

    def __post_init__(self) -> None:
        if self.faults < 1:
            raise ValueError(f"--faults {self.faults} must be >= 1")
        if self.spacing < 2:
            raise ValueError(f"--ray-spacing {self.spacing} must be >= 2")
        if self.health_check_interval <= 0:
            raise ValueError(f"--health-check-interval {self.health_check_interval} must be > 0")

    @property
    def kill_steps(self) -> list[int]:
        return [self.first_step + k * self.spacing for k in range(self.faults)]

    @property
    def steps(self) -> int:
        return self.kill_steps[-1] + self.spacing + self.tail_steps


@dataclass(frozen=True)
class Recovery:
    """One kill and the restart after it, from the step log."""

    mttr_s: float
    restart_s: float
    restore_s: float
    first_step_s: float
    committed_at_kill: int
    resumed_step: int

    @property
    def steps_lost(self) -> int:
        return self.committed_at_kill - self.resumed_step

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "steps_lost": self.steps_lost}


def recovery(events: Sequence[dict[str, Any]], t_kill: float, world: int) -> Recovery | None:
    """The restart after a kill at `t_kill`, or None until its first step is logged.

    The restarted group is the first `world` worker processes seen after the kill (Ray
    Train replaces every worker, survivors included, by new actors in new processes).
    """
    first_seen: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        first_seen.setdefault(e["pid"], e["t"])
    group = sorted((t, pid) for pid, t in first_seen.items() if t > t_kill)[:world]
    pids = {pid for _, pid in group}
    mine = [e for e in events if e["pid"] in pids]
    starts = [e["t"] for e in mine if e["event"] == "start"]
    ready = [e for e in mine if e["event"] == "ready"]
    steps = [e for e in mine if e["event"] == "step"]
    if len(pids) < world or len(starts) < world or len(ready) < world or not steps:
        return None
    first = min(e["t"] for e in steps)
    started, restored = max(starts), max(e["t"] for e in ready)
    before = [e["step"] for e in events if e["event"] == "step" and e["t"] <= t_kill]
    return Recovery(
        mttr_s=first - t_kill,
        restart_s=started - t_kill,
        restore_s=restored - started,
        first_step_s=first - restored,
        committed_at_kill=max(before, default=0),
        resumed_step=min(e["step"] for e in ready),
    )


def victim(events: Sequence[dict[str, Any]], rank: int) -> int | None:
    """The pid of the newest worker process of `rank` (None before it started)."""
    starts = [e for e in events if e["event"] == "start" and e["rank"] == rank]
    return max(starts, key=lambda e: e["t"])["pid"] if starts else None


def steady_step_time(events: Sequence[dict[str, Any]]) -> float | None:
    """Median time between consecutive steps committed by one process (restarts excluded)."""
    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"])
    gaps = [
        b["t"] - a["t"]
        for a, b in itertools.pairwise(steps)
        if a["pid"] == b["pid"] and b["step"] == a["step"] + 1
    ]
    return statistics.median(gaps) if gaps else None


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: bench/torchrun_job.py's loop, checkpointed through Ray Train."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F
    from ray.train import Checkpoint
    from torch.nn.parallel import DistributedDataParallel

    from keepstep.elastic.rng import SampleOrder, rng_scope
    from mlp import make_dataset, make_model

    def log(event: str, **fields: Any) -> None:
        line = {"event": event, "t": time.time(), "pid": os.getpid(), "rank": rank, **fields}
        with open(config["log"], "a") as out:  # one short append per line: no interleaving
            out.write(json.dumps(line) + "\n")

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    log("start")
    torch.set_num_threads(1)
    n_micro = config["global_batch"] // config["micro_batch"]
    assert n_micro * config["micro_batch"] == config["global_batch"], "global = micro x n_micro"
    assert world <= n_micro, f"{world} workers but only {n_micro} micro-batches"
    base = make_model()
    optimizer = torch.optim.AdamW(base.parameters(), lr=3e-3)
    start = 0
    restored = ray.train.get_checkpoint()
    if restored is not None:
        with restored.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        base.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    model = ray.train.torch.prepare_model(base)
    assert isinstance(model, DistributedDataParallel), "Ray Train wraps the model in DDP (gloo)"
    dataset = make_dataset()
    order = SampleOrder(config["seed"], len(dataset), config["micro_batch"], n_micro)
    mine = list(range(rank, n_micro, world))
    log("ready", step=start)
    for step in range(start, config["steps"]):
        for k, mb in enumerate(mine):
            x, y = dataset[order.indices(step, mb)]
            last = k == len(mine) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with rng_scope(config["seed"], step, mb):
                    loss = F.mse_loss(model(x), y)
                (loss * world / n_micro).backward()  # a mean over all micro-batches
            time.sleep(config["sleep"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:
                state = {"step": step + 1, "model": base.state_dict()}
                torch.save({**state, "optimizer": optimizer.state_dict()}, f"{folder}/state.pt")
                checkpoint = Checkpoint.from_directory(folder)
            ray.train.report({"step": step + 1}, checkpoint=checkpoint)  # a barrier
        if rank == 0:
            log("step", step=step + 1)


def is_ray_worker(pid: int) -> bool:
    """Whether `pid` still is a Ray worker process (pids are reused)."""
    try:
        return b"ray::" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_schedule(job: RayTrainJob, log: Path, done: threading.Event) -> list[dict[str, Any]]:
    """SIGKILL one worker at each kill step; one record per kill, once it was recovered."""
    records: list[dict[str, Any]] = []

    def alive() -> bool:
        return not done.is_set()

    for k, target in enumerate(job.kill_steps):

        def reached(t: int = target) -> bool:
            return any(e["event"] == "step" and e["step"] >= t for e in read_log(log))

        wait_for(reached, job.step_timeout, f"step {target}", alive, poll=0.005)
        pid = victim(read_log(log), (k + 1) % WORKERS)
        if pid is None or not is_ray_worker(pid):
            raise RunFailed(f"no live worker of rank {(k + 1) % WORKERS} to kill")
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)

        def recovered(t: float = t_kill) -> Recovery | None:
            return recovery(read_log(log), t, WORKERS)

        found = wait_for(recovered, job.step_timeout, "a step after the restart", alive)
        records.append(found.record())
        print(
            f"  Ray Train kill {k} at step {target}: MTTR {found.mttr_s:.2f} s, "
            f"{found.steps_lost} steps lost",
            flush=True,
        )
    return records


def run_ray_train(job: RayTrainJob, workdir: Path, seed: int) -> dict[str, Any]:
    """One TorchTrainer run on a local Ray cluster with `job.faults` worker kills."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log = workdir / "steps.jsonl"
    config = {
        "log": str(log), "seed": seed, "steps": job.steps, "sleep": job.sleep,
        "global_batch": job.global_batch, "micro_batch": job.micro_batch,
    }  # fmt: skip
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name="mttr",
            storage_path=str(workdir / "results"),
            failure_config=FailureConfig(max_failures=job.faults),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": WORKERS})
    done, out, failed = threading.Event(), [], []

    def kills() -> None:
        try:
            out.extend(kill_schedule(job, log, done))
        except Exception as error:  # reported after fit() returns
            failed.append(error)

    killer = threading.Thread(target=kills, daemon=True)
    started = time.monotonic()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        killer.start()
        result = trainer.fit()
    finally:
        done.set()
        killer.join(timeout=30)
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
    wall = time.monotonic() - started
    left = descendants(os.getpid())
    for pid in left:  # processes of the cluster that outlived its shutdown: ours to end
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if failed:
        raise failed[0]
    events = read_log(log)
    last = max((e["step"] for e in events if e["event"] == "step"), default=0)
    if result.error is not None or last != job.steps or len(out) != job.faults:
        raise RunFailed(f"Ray Train: {result.error}; {last}/{job.steps} steps, {len(out)} kills")
    return {
        **figures(out, PHASES),
        "steps_lost_p50": percentile([float(r["steps_lost"]) for r in out], 0.5),
        "steady_step_s": steady_step_time(events),
        "wall_s": round(wall, 1),
        "processes_left": len(left),
        "records": out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=2, help="for Ray Train and for keepstep")
    parser.add_argument("--ray-spacing", type=int, default=10, help="steps between kills")
    parser.add_argument(
        "--health-check-interval", type=float, default=2.0, help="s, Ray Train's controller poll"
    )
    parser.add_argument("--json", help="also write every figure and record here")
    mttr.add_settings_args(parser)
    args = parser.parse_args()
    try:
        s = mttr.settings_from(args)
        job = RayTrainJob(
            s.global_batch,
            s.micro_batch,
            s.sleep,
            faults=args.faults,
            spacing=args.ray_spacing,
            health_check_interval=args.health_check_interval,
        )
    except ValueError as error:
        parser.error(str(error))
    # Read here, at the entry point: the cluster's processes inherit this environment.
    paths = [str(REPO / "examples"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(job.health_check_interval)
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="keepstep-ray-train-"))
    (workdir / "ray-train").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        ray_train = run_ray_train(job, workdir / "ray-train", s.seed)
        keepstep = mttr.measure(["kill-worker"], args.faults, s, workdir / "keepstep")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    ks = keepstep["kinds"]["kill-worker"]
    if ks["mttr_p50_s"] is None:
        raise SystemExit(f"keepstep: no kill-worker recovery measured: {keepstep['violations']}")
    rp, ratio = ray_train["phase_p50_s"], ray_train["mttr_p50_s"] / ks["mttr_p50_s"]
    step = ray_train["steady_step_s"]
    print(
        f"\nRay Train restart from checkpoint (FailureConfig(max_failures={job.faults}), "
        f"health check {job.health_check_interval:g} s), {ray_train['count']} worker kills: "
        f"MTTR p50 {ray_train['mttr_p50_s']:.3f} s, p95 {ray_train['mttr_p95_s']:.3f} s "
        f"(p50: restart {rp['restart_s']:.3f}, restore {rp['restore_s']:.3f}, first step "
        f"{rp['first_step_s']:.3f}), steps lost p50 {ray_train['steps_lost_p50']:g}, "
        f"steady step {'-' if step is None else f'{step:.3f}'} s\n"
        f"keepstep kill-worker, {ks['count']} kills: MTTR p50 {ks['mttr_p50_s']:.3f} s, "
        f"p95 {ks['mttr_p95_s']:.3f} s, rolled back p50 {ks['rolled_back_steps_p50']:g}\n"
        f"MTTR p50 ratio Ray Train / keepstep: {ratio:.1f}x"
    )
    for v in keepstep["violations"]:
        print(f"VIOLATION (keepstep): {v}")
    print(
        f"({time.monotonic() - t0:.0f} s in all; processes of the Ray cluster left after its "
        f"shutdown: {ray_train['processes_left']})"
    )
    if args.json:
        report = {
            "job": {"global_batch": s.global_batch, "micro_batch": s.micro_batch,
                    "sleep": s.sleep, "workers": WORKERS, "ray_train_steps": job.steps,
                    "kill_steps": job.kill_steps},
            "ray_train": ray_train,
            "keepstep_kill_worker": keepstep,
            "ratio_p50": ratio,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
