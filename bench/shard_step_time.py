"""Step-time cost of sharding the optimizer state, against full replicas and DDP (gloo).

    scripts/env python bench/shard_step_time.py [--ranks 2] [--steps 6] [--sizes large-short]
        [--shards none,zero1,zero2] [--repeat 3] [--json PATH]

On the example transformer (examples/transformer.py, AdamW), with W ranks, the same global
batch and the same micro-batch split, it times:

    keepstep full     exact mode, a full optimizer on every member (shard=None)
    keepstep zero1    exact mode, shard="zero1" (each member steps its own shard)
    keepstep zero2    exact mode, shard="zero2" (the reduced gradient sharded too)
    ddp               DistributedDataParallel, torch.optim.AdamW, no_sync() accumulation
    ddp zero          the same with torch's ZeroRedundancyOptimizer (PyTorch's ZeRO-1)

--shards picks the keepstep rows. The configurations run in turn, round after round
(--repeat), so drift hits all alike; a run's figure is the median of its steps (the first
two dropped as warm-up when there are more than three), a configuration's the median over
rounds, given with its ratio to DDP and to keepstep's full replicas (target: ZeRO-1 within
10% of full). keepstep's step time is its `step_seconds`, snapshot included. Each row also
gives a rank's CPU seconds a step (every thread of its process; the ranks' mean): with
fewer cores than ranks the wall time is mostly waiting, and the CPU time is the cost a
machine with a core per rank would see. A failed run is reported with its log's tail and
not run again. DDP ranks are this file run as `ddp-worker`. "large-short" takes about 1 s
a step on 2 CPU ranks; "large" about 4 s.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from keepstep.elastic.config import Shard
from keepstep.launch.local import LocalRun, run_local

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "transformer.py"
VOCAB = 128
LR = 1e-3
TARGET = 1.10  # ZeRO-1 step time over full replicas, as the project quotes it
SIZES = {  # name: (d_model, layers, seq, micro_batch); bench/step_time.py's and one more
    "small": (64, 2, 64, 2),
    "medium": (192, 4, 256, 1),
    # The large model (~11M parameters: the same optimizer state and all-gather) on a
    # quarter of the tokens: ~1 s a step on 2 CPU ranks, so sharding's cost shows more.
    "large-short": (384, 6, 256, 1),
    "large": (384, 6, 1024, 1),
}
SHARDS = ("none", *(s.value for s in Shard))


class RunFailed(Exception):
    """A run of one configuration exited badly; the message ends with its log's tail."""


@dataclass(frozen=True)
class Timing:
    """A run's figures: rank 0's median step seconds, and the ranks' CPU seconds a step."""

    wall: float
    cpu: float


def _timing(walls: list[float], cpus: list[list[float]]) -> Timing:
    """`walls`: rank 0's step times; `cpus`: per rank, its CPU seconds per step."""
    per_step = [statistics.fmean(step) for step in zip(*cpus, strict=True)]
    return Timing(_median(walls), _median(per_step))


@dataclass(frozen=True)
class Config:
    """One system to time: keepstep with a shard setting ("none": full), or DDP."""

    name: str
    keepstep: bool
    shard: str | None = None  # keepstep's shard=; None: full replicas
    zero: bool = False  # DDP: ZeroRedundancyOptimizer instead of AdamW


@dataclass(frozen=True)
class Workload:
    """The model and batch every configuration trains; `n_micro` micro-batches per step."""

    d_model: int
    layers: int
    seq: int
    micro_batch: int
    n_micro: int
    steps: int
    ranks: int
    timeout: float

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.n_micro

    @property
    def heads(self) -> int:
        return max(1, self.d_model // 64)


def _example() -> ModuleType:
    """examples/transformer.py as a module (TinyGPT, CopyTask)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    return importlib.import_module(EXAMPLE.stem)


@functools.cache
def _param_count(w: Workload) -> int:
    model: torch.nn.Module = _example().TinyGPT(VOCAB, w.seq, w.d_model, w.layers, w.heads)
    return sum(p.numel() for p in model.parameters())  # the count: the seed does not matter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median(times: list[float]) -> float:
    """A run's step time: the median, the first two steps dropped as warm-up."""
    return statistics.median(times[2:] if len(times) > 3 else times)


def configs(shards: list[str]) -> list[Config]:
    """The configurations to time, in the order they run in each round."""
    out = [
        Config(f"keepstep {s if s != 'none' else 'full'}", True, None if s == "none" else s)
        for s in shards
    ]
    return [*out, Config("ddp", False), Config("ddp zero", False, zero=True)]


def run_keepstep(shard: str | None, w: Workload, tmp: Path) -> Timing:
    """One keepstep exact-mode run on W local processes; its step times."""
    env = dict(os.environ)
    env.pop("KEEPSTEP_SHARD", None)
    if shard is not None:
        env["KEEPSTEP_SHARD"] = shard
    args = ["--d-model", str(w.d_model), "--layers", str(w.layers), "--seq", str(w.seq)]
    result = run_local(
        LocalRun(
            script=str(EXAMPLE),
            steps=w.steps,
            global_batch=w.global_batch,
            micro_batch=w.micro_batch,
            schedule=[[f"r{i}" for i in range(w.ranks)]],
            mode="exact",
            script_args=[*args, "--heads", str(w.heads), "--vocab", str(VOCAB)],
            timeout=w.timeout,
        ),
        tmp,
        env,
    )
    failed = [m for m, code in result.returncodes.items() if code != 0]
    if failed:
        raise RunFailed(f"keepstep shard={shard} failed:\n" + result.logs[failed[0]][-2000:])
    first = result.results["r0"]
    if shard is not None and w.ranks > 1:  # the run must really have sharded
        stepped = first["reconfigurations"][-1]["stepped_elements"]
        assert stepped is not None and stepped < _param_count(w), (shard, stepped)
    cpus = [r["step_cpu_seconds"] for r in result.results.values()]
    return _timing(first["step_seconds"], cpus)


def run_ddp(zero: bool, w: Workload, tmp: Path) -> Timing:
    """One DDP run, W `ddp-worker` processes over gloo; its step times."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    argv = [sys.executable, __file__, "ddp-worker", str(tmp), str(w.steps), str(w.global_batch)]
    argv += [str(w.micro_batch), str(w.d_model), str(w.layers), str(w.seq), str(int(zero))]
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp / f"log-{rank}.txt" for rank in range(w.ranks)]
    try:
        for rank, log in enumerate(logs):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(w.ranks))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            env.update(GLOO_SOCKET_IFNAME="lo")
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + w.timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(codes):
        raise RunFailed(f"DDP (zero={zero}) failed:\n" + logs[0].read_text()[-2000:])
    ranks = [json.loads((tmp / f"ddp-{r}.json").read_text()) for r in range(w.ranks)]
    return _timing(ranks[0]["step_seconds"], [r["step_cpu_seconds"] for r in ranks])


def ddp_worker(argv: list[str]) -> None:
    """One DDP rank: train `steps` steps, write its step wall and CPU times into argv[0]."""
    out, steps, gb, mb = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    d, layers, seq, zero = int(argv[4]), int(argv[5]), int(argv[6]), argv[7] == "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    example = _example()
    torch.manual_seed(0)
    model = DistributedDataParallel(example.TinyGPT(VOCAB, seq, d, layers, max(1, d // 64)))
    opt: torch.optim.Optimizer
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data: Any = example.CopyTask(4096, seq, VOCAB)
    n_micro = gb // mb
    assert n_micro * mb == gb, (gb, mb)
    mine = [i for i in range(n_micro) if i % world == rank]
    times, cpus = [], []
    for step in range(steps):
        t0, cpu0 = time.perf_counter(), time.process_time()
        for k, i in enumerate(mine):
            base = (step * n_micro + i) * mb
            x, y = zip(*(data[(base + j) % len(data)] for j in range(mb)), strict=True)
            sync = k == len(mine) - 1  # one all-reduce per step, after the last micro-batch
            with contextlib.nullcontext() if sync else model.no_sync():
                logits = model(torch.stack(x))
                loss = F.cross_entropy(logits.flatten(0, 1), torch.stack(y).flatten())
                torch.autograd.backward(loss * world / n_micro)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - cpu0)
    figures = {"step_seconds": times, "step_cpu_seconds": cpus}
    (Path(out) / f"ddp-{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def run_round(cs: list[Config], w: Workload, tmp: Path) -> dict[str, Timing | None]:
    """Every configuration once, in order: name -> its step times (None: it failed)."""
    out: dict[str, Timing | None] = {}
    for i, c in enumerate(cs):
        where = tmp / f"{i}"
        try:
            s = run_keepstep(c.shard, w, where) if c.keepstep else run_ddp(c.zero, w, where)
        except RunFailed as error:
            print(f"  {c.name:15} FAILED, not run again:\n{error}", file=sys.stderr, flush=True)
            out[c.name] = None
            continue
        out[c.name] = s
        print(f"  {c.name:15} {s.wall:8.3f} s, {s.cpu:8.3f} CPU-s a rank", flush=True)
    return out


def _over(a: float | None, b: float | None) -> float | None:  # None: a run failed
    return a / b if a and b else None


def table(runs: dict[str, list[Timing] | None]) -> list[dict[str, Any]]:
    """One row per configuration (medians over rounds) with its ratios, wall and CPU, to
    DDP and to keepstep's full replicas."""
    wall = {k: None if v is None else statistics.median(t.wall for t in v) for k, v in runs.items()}
    cpu = {k: None if v is None else statistics.median(t.cpu for t in v) for k, v in runs.items()}
    return [
        {
            "config": name,
            "median_s": wall[name],
            "cpu_s": cpu[name],
            "over_ddp": _over(wall[name], wall.get("ddp")),
            "over_full": _over(wall[name], wall.get("keepstep full")),
            "cpu_over_ddp": _over(cpu[name], cpu.get("ddp")),
            "cpu_over_full": _over(cpu[name], cpu.get("keepstep full")),
        }
        for name in runs
    ]


def _ratio(r: float | None) -> str:
    return f"{r:.3f}x" if r is not None else "-"


def _seconds(s: float | None) -> str:
    return f"{s:.3f}" if s is not None else "failed"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'configuration':15} {'step s':>8} {'/ ddp':>8} {'/ full':>8}", end=" ")
    print(f"{'CPU-s a rank':>12} {'/ ddp':>8} {'/ full':>8}")
    for r in rows:
        print(
            f"{r['config']:15} {_seconds(r['median_s']):>8} {_ratio(r['over_ddp']):>8} "
            f"{_ratio(r['over_full']):>8} {_seconds(r['cpu_s']):>12} "
            f"{_ratio(r['cpu_over_ddp']):>8} {_ratio(r['cpu_over_full']):>8}"
        )


def print_target(rows: list[dict[str, Any]]) -> None:
    """The quoted target: keepstep ZeRO-1 (and ZeRO-2) step time within 10% of full."""
    if not any(r["config"] == "keepstep full" for r in rows):
        print("no keepstep full row (--shards without none): no ratio to full replicas")
    for r in rows:
        if r["config"] not in ("keepstep zero1", "keepstep zero2"):
            continue
        for what, key in (("step time", "over_full"), ("CPU a step", "cpu_over_full")):
            if r[key] is not None:
                met = "met" if r[key] <= TARGET else "NOT met"
                print(f"{r['config']} / keepstep full, {what}: {r[key]:.3f} (<= {TARGET}: {met})")


def _shards(given: str) -> list[str]:
    """The --shards list, checked."""
    shards = [s.strip() for s in given.split(",") if s.strip()]
    if bad := [s for s in shards if s not in SHARDS]:
        raise SystemExit(f"--shards {given!r}: {bad} not among {', '.join(SHARDS)}")
    return shards


def bench_size(name: str, args: argparse.Namespace, shards: list[str]) -> dict[str, Any]:
    """All configurations on one model size, interleaved over --repeat rounds."""
    d, layers, seq, mb = SIZES[name]
    w = Workload(d, layers, seq, mb, args.micro_batches, args.steps, args.ranks, args.timeout)
    params = _param_count(w)
    print(
        f"\n{name}: TinyGPT d={d} layers={layers} seq={seq} vocab={VOCAB}, {params:,} params, "
        f"AdamW lr={LR}; {w.ranks} ranks, global batch {w.global_batch} = "
        f"{w.n_micro} x {mb}, {w.steps} steps, {args.repeat} round(s)",
        flush=True,
    )
    cs = configs(shards)
    runs: dict[str, list[Timing]] = {c.name: [] for c in cs}
    failed: set[str] = set()
    for rep in range(args.repeat):  # interleaved: drift hits every configuration alike
        print(f" round {rep + 1}/{args.repeat}", flush=True)
        with tempfile.TemporaryDirectory(prefix="keepstep-shard-step-") as tmp:
            live = [c for c in cs if c.name not in failed]
            for k, v in run_round(live, w, Path(tmp)).items():
                if v is None:
                    failed.add(k)
                else:
                    runs[k].append(v)
    rows = table({k: None if k in failed else v for k, v in runs.items()})
    print_table(rows)
    print_target(rows)
    return {
        "size": name,
        "d_model": d,
        "layers": layers,
        "seq": seq,
        "micro_batch": mb,
        "global_batch": w.global_batch,
        "params": params,
        "optimizer": "AdamW",
        "runs_s": {k: [t.wall for t in v] for k, v in runs.items()},
        "runs_cpu_s": {k: [t.cpu for t in v] for k, v in runs.items()},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4, help="per step, all ranks")
    parser.add_argument("--sizes", default="large-short", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--shards", default=",".join(SHARDS), help="keepstep rows to run")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, interleaved")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        raise SystemExit(f"--sizes {args.sizes!r}: {unknown} not among {', '.join(SIZES)}")
    if not 1 <= args.ranks <= args.micro_batches:  # every rank trains a micro-batch a step
        raise SystemExit(f"--ranks {args.ranks}: must be 1..--micro-batches ({args.micro_batches})")
    shards = _shards(args.shards)
    results = [bench_size(name, args, shards) for name in sizes]
    if args.json:
        figures = {"ranks": args.ranks, "steps": args.steps, "repeat": args.repeat}
        Path(args.json).write_text(json.dumps({**figures, "sizes": results}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1:2] == ["ddp-worker"]:
        ddp_worker(sys.argv[2:])
    else:
        main()
