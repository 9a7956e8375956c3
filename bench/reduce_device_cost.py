"""What the exact reduction's device path costs per micro-batch, and where: the fused
quantize-and-accumulate (reduce_device.py) eager and compiled, against fp32 accumulation
into .grad, on gradients shaped like bench/gpu_check.py's figures (3/4 of the elements in
48 big tensors, 1/4 in 64 small ones), plus one call on one tensor of all the elements.

    python3 bench/reduce_device_cost.py [--numel N] [--profile]

Prints JSON: ms per call of each variant (the median of 5 after a warm one) and, with
--profile, the top CUDA kernels and CPU ops of one compiled micro-batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "elastic"))

from keepstep.elastic.reduce_device import DeviceOps, quantize_add  # noqa: E402
from keepstep.elastic.rng import fix_determinism  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**26)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    fix_determinism(8)
    dev = torch.device("cuda", 0)
    shapes = [args.numel // 64] * 48 + [args.numel // 256] * 64
    grads = [torch.randn(n, device=dev) for n in shapes]
    params = [torch.zeros(n, device=dev) for n in shapes]
    offsets = [0]
    for n in shapes[:-1]:
        offsets.append(offsets[-1] + n)
    acc = torch.zeros(sum(shapes), dtype=torch.float64, device=dev)
    specs = [(torch.Size([n]), torch.float32) for n in shapes]
    out: dict[str, object] = {"elements": sum(shapes), "tensors": len(shapes)}
    out["fp32_foreach_add_ms"] = median_ms(lambda: torch._foreach_add_(params, grads))
    given = list(enumerate(grads))
    for name, compile_ in (("eager", False), ("compiled", True)):
        ops = DeviceOps(specs, offsets, dev, compile=compile_)
        ops.set_scales(torch.ones(len(shapes), dtype=torch.float64, device=dev))
        out[f"{name}_ms"] = median_ms(partial(ops.add, given, acc))
    scale = torch.ones((), dtype=torch.float32, device=dev)
    one = torch.randn(sum(shapes), device=dev)
    with torch.no_grad():
        out["eager_one_tensor_ms"] = median_ms(lambda: quantize_add(one, scale, acc))
        static = torch.compile(quantize_add, fullgraph=True, dynamic=False)
        out["static_one_tensor_ms"] = median_ms(lambda: static(one, scale, acc))
        dynamic = torch.compile(quantize_add, fullgraph=True, dynamic=True)
        out["dynamic_one_tensor_ms"] = median_ms(lambda: dynamic(one, scale, acc))
        out["dynamic_one_tensor_view_ms"] = median_ms(lambda: dynamic(one[2:], scale, acc[2:]))
    if args.profile:
        ops = DeviceOps(specs, offsets, dev, compile=True)
        ops.set_scales(torch.ones(len(shapes), dtype=torch.float64, device=dev))
        ops.add(given, acc)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            ops.add(given, acc)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
        out["profile_cuda"] = table
        out["profile_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
