"""Cost of the gradient reducers on a ~10M-parameter transformer-shaped set of tensors.

    scripts/env python bench/reduce_cost.py [--device cuda] [--dtype bfloat16] [--repeats 7]

Prints the median time of `add_micro_batch` (paid once per micro-batch) and of `finish`
(once per step) in exact and fast mode, beside what DDP-style gradient accumulation pays
per micro-batch (one in-place float add into `.grad`). The all-reduce itself is not timed:
exact mode sends int64 (8 bytes per parameter), fast mode float32 (4 bytes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from keepstep.elastic.reduce import ReduceDone, ReduceMode, make_reducer


def transformer_shapes(d: int = 384, layers: int = 5, vocab: int = 4096) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # norm, qkv, proj
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # norm, mlp
    return [*shapes, (d,), (d,)]


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms caches and allocators
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-micro", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(s, dtype=dtype, device=device) for s in transformer_shapes()]
    grads = [
        torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in transformer_shapes()
    ]
    numel = sum(p.numel() for p in params)
    print(
        f"{numel / 1e6:.2f}M parameters in {len(params)} tensors, {dtype}, {device}, "
        f"n_micro={args.n_micro}, threads={args.threads}, median of {args.repeats}"
    )

    accum = [torch.zeros_like(p) for p in params]
    ddp = median_ms(lambda: torch._foreach_add_(accum, grads), device, args.repeats)
    print(f"{'ddp-style .grad +=':<20} add {ddp:8.2f} ms ({ddp * 1e6 / numel:5.2f} ns/param)")
    for mode in ReduceMode:
        reducer = make_reducer(mode, params, args.n_micro)
        reducer.begin_step()
        add = median_ms(partial(reducer.add_micro_batch, grads), device, args.repeats)
        reducer.begin_step()
        for _ in range(args.n_micro):
            reducer.add_micro_batch(grads)
        reduced = reducer.buffer().clone()
        outcome = reducer.finish(reduced, args.n_micro, params)
        assert isinstance(outcome, ReduceDone), outcome
        fin = median_ms(
            partial(reducer.finish, reduced, args.n_micro, params), device, args.repeats
        )
        mib = reduced.numel() * reduced.element_size() / 2**20
        print(
            f"{mode.value:<20} add {add:8.2f} ms ({add * 1e6 / numel:5.2f} ns/param)   "
            f"finish {fin:8.2f} ms   buffer {mib:.0f} MiB"
        )


if __name__ == "__main__":
    main()
