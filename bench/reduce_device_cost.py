"""What the exact reduction's device path costs per micro-batch, and where: the fused
quantize-and-accumulate (reduce_device.py) eager tensor by tensor and the whole micro-batch
as one compiled call (reduce_graph.py; also with Inductor's combo kernels), against fp32
accumulation into .grad, on gradients shaped like bench/gpu_check.py's figures (3/4 of the
elements in 48 big tensors, 1/4 in 64 small ones), plus one call on one tensor of all the
elements.

    python3 bench/reduce_device_cost.py [--numel N] [--profile]

Prints JSON: ms per call of each variant (`*_ms`, the median of 5 after a warm one), the
same per 1e9 elements (`per_1e9_elements_ms`) and over fp32 `_foreach_add_` of the same
gradients (`vs_fp32_foreach`: the issue's target is <= 2), the CUDA kernels one call of
each micro-batch graph launches (`*_kernels`), the seconds to build each (compile and
warm-up) and to build it again in a fresh process on the caches the first filled
(`graph_build_restart_s`: what a restarted worker pays), and with --profile the top CUDA
kernels and CPU ops of one micro-batch graph call. Each figure also goes to stderr as it
is measured, so a run cut short by a time limit still shows the ones it had.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "elastic"))

from keepstep.elastic.reduce_device import AddPath, DeviceOps, quantize_add  # noqa: E402
from keepstep.elastic.reduce_graph import MicroBatchGraph  # noqa: E402
from keepstep.elastic.rng import fix_determinism  # noqa: E402

TARGET = 2.0  # the bound on the exact reduction over fp32 accumulation


def median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


class Figures(dict[str, object]):
    """The JSON's figures; each one set is also printed to stderr at once."""

    def __setitem__(self, key: str, value: object) -> None:
        print(f"reduce_device_cost: {key} = {value}", file=sys.stderr)
        super().__setitem__(key, value)


def timed_s(build: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    built = build()
    torch.cuda.synchronize()
    return built, time.perf_counter() - start


def kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels one call launches (after a warm one)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.profiler.DeviceType.CUDA)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    fix_determinism(8)
    dev = torch.device("cuda", 0)
    shapes = [args.numel // 64] * 48 + [args.numel // 256] * 64
    if args.build_only:  # a restarted worker: a fresh process, this machine's caches warm
        specs = [(torch.Size([n]), torch.float32) for n in shapes]
        offsets = [sum(shapes[:i]) for i in range(len(shapes))]
        print(timed_s(lambda: DeviceOps(specs, offsets, dev, compile=True))[1])
        return 0
    grads = [torch.randn(n, device=dev) for n in shapes]
    params = [torch.zeros(n, device=dev) for n in shapes]
    offsets = [0]
    for n in shapes[:-1]:
        offsets.append(offsets[-1] + n)
    acc = torch.zeros(sum(shapes), dtype=torch.float64, device=dev)
    specs = [(torch.Size([n]), torch.float32) for n in shapes]
    scale_vec = torch.ones(len(shapes), dtype=torch.float64, device=dev)
    out = Figures(elements=sum(shapes), tensors=len(shapes))
    out["fp32_foreach_add_ms"] = median_ms(lambda: torch._foreach_add_(params, grads))
    given = list(enumerate(grads))
    # First: the build compiles the micro-batch graph.
    ops, out["graph_build_s"] = timed_s(lambda: DeviceOps(specs, offsets, dev, compile=True))
    assert isinstance(ops, DeviceOps)
    # The same build in a new process, on the compile caches this one just filled: what a
    # worker restarted on this node pays before its first micro-batch (not counting imports).
    again = subprocess.run(
        [sys.executable, __file__, "--numel", str(args.numel), "--build-only"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = again.stdout.split()
    out["graph_build_restart_s"] = float(lines[-1]) if again.returncode == 0 and lines else None
    ops.set_scales(scale_vec)
    graph_call = partial(ops.add, given, acc)
    out["graph_ms"] = median_ms(graph_call)
    assert ops.last_path == AddPath.GRAPH, ops.last_path  # not its eager fallback
    out["graph_kernels"] = kernels(graph_call)
    eager = DeviceOps(specs, offsets, dev, compile=False)  # tensor by tensor
    eager.set_scales(scale_vec)
    out["eager_ms"] = median_ms(partial(eager.add, given, acc))
    combo, out["graph_combo_build_s"] = timed_s(
        lambda: MicroBatchGraph(specs, offsets, dev, combo_kernels=True)
    )
    assert isinstance(combo, MicroBatchGraph)
    combo_call = partial(combo, grads, scale_vec, acc)
    out["graph_combo_ms"] = median_ms(combo_call)
    assert combo_call()[1], "the combo graph ran eager"
    out["graph_combo_kernels"] = kernels(combo_call)
    scale = torch.ones((), dtype=torch.float32, device=dev)
    one = torch.randn(sum(shapes), device=dev)
    with torch.no_grad():
        out["eager_one_tensor_ms"] = median_ms(lambda: quantize_add(one, scale, acc))
        static = torch.compile(quantize_add, fullgraph=True, dynamic=False)
        out["static_one_tensor_ms"] = median_ms(lambda: static(one, scale, acc))
        dynamic = torch.compile(quantize_add, fullgraph=True, dynamic=True)
        out["dynamic_one_tensor_ms"] = median_ms(lambda: dynamic(one, scale, acc))
        out["dynamic_one_tensor_view_ms"] = median_ms(lambda: dynamic(one[2:], scale, acc[2:]))
    # Every variant handles all the elements once: ms per 1e9 of them, and over fp32.
    timings = {k: v for k, v in out.items() if k.endswith("_ms") and isinstance(v, float)}
    base = timings["fp32_foreach_add_ms"]
    ratios = {k: v / base for k, v in timings.items()}
    out["per_1e9_elements_ms"] = {k: v * 1e9 / sum(shapes) for k, v in timings.items()}
    out["vs_fp32_foreach"] = ratios
    out["target_vs_fp32_foreach"] = TARGET
    out["graph_within_target"] = min(ratios["graph_ms"], ratios["graph_combo_ms"]) <= TARGET
    if args.profile:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            graph_call()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
        out["profile_cuda"] = table
        out["profile_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
