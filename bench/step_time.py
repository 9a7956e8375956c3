"""Exact-mode step time against plain DDP (gloo), on the example transformer.

    scripts/env python bench/step_time.py [--ranks 2] [--steps 6] [--sizes large,medium,small]

For each model size it runs keepstep exact, keepstep fast and DDP with the same global
batch and micro-batch split, interleaved so machine drift hits all alike, and prints the
median step time (first two steps dropped as warm-up) and the ratio to DDP. "large" is the
target workload: ~11M parameters, 1,024 tokens per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from keepstep.launch.local import LocalRun, run_local

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # name: (d_model, layers, seq, micro_batch)
    "small": (64, 2, 64, 2),
    "medium": (192, 4, 256, 1),
    "large": (384, 6, 1024, 1),
}


def _median(times: list[float]) -> float:
    return statistics.median(times[2:] if len(times) > 3 else times)


def run_keepstep(
    mode: str, ranks: int, steps: int, gb: int, size: tuple[int, ...], tmp: Path
) -> float:
    d, layers, seq, mb = size
    result = run_local(
        LocalRun(
            script=str(REPO / "examples" / "transformer.py"),
            steps=steps,
            global_batch=gb,
            micro_batch=mb,
            schedule=[[f"r{i}" for i in range(ranks)]],
            mode=mode,
            script_args=[
                "--d-model",
                str(d),
                "--layers",
                str(layers),
                "--seq",
                str(seq),
                "--heads",
                str(max(1, d // 64)),
            ],
            timeout=3000,
        ),
        tmp,
    )
    if any(code != 0 for code in result.returncodes.values()):
        raise SystemExit(f"keepstep {mode} failed:\n" + next(iter(result.logs.values()))[-2000:])
    return _median(result.results["r0"]["step_seconds"])


def run_ddp(ranks: int, steps: int, gb: int, size: tuple[int, ...], tmp: Path) -> float:
    d, layers, seq, mb = size
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "ddp.json"
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(REPO / "bench" / "ddp_transformer.py"),
                    str(out),
                    str(steps),
                    str(gb),
                    str(mb),
                    str(d),
                    str(layers),
                    str(seq),
                ],
                env=env,
            )
        )
    for p in procs:
        if p.wait(timeout=3000) != 0:
            raise SystemExit("DDP run failed")
    times: list[float] = json.loads(out.read_text())["step_seconds"]
    return _median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4, help="per step, all ranks")
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--repeat", type=int, default=1, help="runs per system, interleaved")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    rows = []
    for name in args.sizes.split(","):
        size = SIZES[name]
        gb = size[3] * args.micro_batches
        runs: dict[str, list[float]] = {"ddp": [], "exact": [], "fast": []}
        for rep in range(args.repeat):  # interleaved: drift hits every system alike
            with tempfile.TemporaryDirectory() as tmp:
                t = Path(tmp) / str(rep)
                runs["ddp"].append(run_ddp(args.ranks, args.steps, gb, size, t / "ddp"))
                for mode in ("exact", "fast"):
                    runs[mode].append(
                        run_keepstep(mode, args.ranks, args.steps, gb, size, t / mode)
                    )
        ddp, exact, fast = (statistics.median(runs[k]) for k in ("ddp", "exact", "fast"))
        d, layers, seq, mb = size
        rows.append(
            {
                "size": name,
                "d_model": d,
                "layers": layers,
                "tokens_per_micro_batch": seq * mb,
                "ddp_s": ddp,
                "exact_s": exact,
                "fast_s": fast,
                "exact_over_ddp": exact / ddp,
                "fast_over_ddp": fast / ddp,
            }
        )
        r = rows[-1]
        print(
            f"{name:7} d={d:<4} layers={layers} tokens/mb={seq * mb:<5} "
            f"ddp {ddp:7.3f}s  exact {exact:7.3f}s ({r['exact_over_ddp']:.3f}x)  "
            f"fast {fast:7.3f}s ({r['fast_over_ddp']:.3f}x)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
