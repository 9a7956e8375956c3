"""The figures of bench/gpu_check.py: the exact reducer's fused quantize-and-accumulate,
eager and (on a GPU) compiled, in ms per 1e9 parameters next to a plain fp32 gradient
accumulation of the same tensors (the issue's target: at most 2x).

Where it sits: gpu_check.main calls `figures(device, numel, micro_batches)` after its
checks; a figure is a measurement, never a check, so nothing here can fail the run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from keepstep.elastic.reduce import ExactReducer


def median_s(fn: Callable[[], object], device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first warms caches and the allocator
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def figures(device: str, numel: int, micro_batches: int) -> dict[str, float]:
    shapes = [(numel // 64,)] * 48 + [(numel // 256,)] * 64  # 3/4 in big tensors, 1/4 small
    params = [torch.zeros(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    total = sum(p.numel() for p in params)
    out = {"params": float(total)}

    def accumulate() -> None:
        torch._foreach_add_(params, grads)

    out["fp32_accumulate_ms_per_1e9"] = median_s(accumulate, device, 5) * 1e12 / total
    variants: dict[str, dict[str, Any]] = {"fused_eager": {"compile": False}}
    if device == "cuda":
        variants["fused"] = {}
    for name, extra in variants.items():
        reducer = ExactReducer(params, micro_batches, device_ops=True, **extra)
        reducer.begin_step()
        ms = median_s(partial(reducer.add_micro_batch, grads), device, 5) * 1e12 / total
        out[f"{name}_ms_per_1e9"] = ms
        out[f"{name}_vs_fp32_accumulate"] = ms / out["fp32_accumulate_ms_per_1e9"]
    return out
