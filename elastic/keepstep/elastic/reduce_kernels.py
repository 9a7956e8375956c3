"""Fused CPU kernels for the exact reduction: one pass over each gradient instead of five.

Where it sits: `ExactReducer` (reduce_exact.py) uses `CpuKernels` for float32 and float64
parameters on the CPU when numba is importable; everything else (accelerators, bfloat16 and
float16, no numba) takes the tensor-op path beside it. Both paths do the same exact
arithmetic, so they give the same bits and may be mixed across ranks and tensors
(tests/elastic/test_reduce_kernels.py checks that, including non-finite and overflowing
gradients).

Why: per micro-batch the tensor-op path makes separate passes to find max |g|, multiply by
2**k, round, widen to float64 and add, plus a few dozen small ops per tensor; on a CPU that
is memory traffic and dispatch, ~3x the time of one loop that reads g once and updates the
float64 sum in place. numba (a maintained LLVM JIT with wheels for every platform torch
ships) compiles these loops without a C++ toolchain in the training image; compiled code is
cached on disk, and `CpuKernels` compiles at construction, so a joining worker pays it
before it joins, not inside a step.

The arithmetic, per element x of a gradient whose tensor scale is s = 2**k:
    acc += round_half_even(x * s)     in x's dtype (float32 or float64), then widened
(the step's first micro-batch assigns q + 0.0 instead, so the buffer need not be zeroed
first: adding +0.0 turns a -0.0 into +0.0, as adding q to a zeroed buffer would) and
per tensor peak = max |x| (nan if any x is nan, else inf if any is inf), exactly what
`reduce_base.abs_max` gives. `finish` writes grad = (sum / d) rounded to the grad's dtype,
d = n_micro * s, as the tensor path's float64 division and cast do.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

KERNEL_DTYPES = (torch.float32, torch.float64)


def available() -> bool:
    """True when numba can be imported (the fused kernels can run)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def _compile() -> tuple[dict[Any, Callable[..., Any]], Callable[..., Any], Callable[..., Any]]:
    import numba  # imported here: the rest of the library never needs it

    jit = numba.njit(nogil=True, cache=True)

    # max |x| is taken over the bit patterns with the sign bit cleared: for non-negative
    # floats the integer order is the float order, every nan pattern is above inf's, and an
    # integer max vectorizes where a float max (with nan rules) does not. The result read
    # back as a float is max |x|, inf, or a nan, as `reduce_base.abs_max` gives. One loop per
    # width: a single loop typed through a caller's integer buffer ran at half the speed.
    @jit
    def quantize_add32(grad: Any, scale: Any, acc: Any, first: bool) -> Any:
        g = grad.reshape(grad.size)  # a view: the caller passes C-contiguous arrays
        bits = g.view(np.uint32)
        hi = np.uint32(0)
        for i in range(g.size):
            hi = max(hi, bits[i] & np.uint32(0x7FFFFFFF))
            q = np.rint(g[i] * scale)
            acc[i] = q + 0.0 if first else acc[i] + q  # + 0.0: as if acc started at +0.0
        out = np.empty(1, np.uint32)
        out[0] = hi
        return out.view(np.float32)[0]

    @jit
    def quantize_add64(grad: Any, scale: Any, acc: Any, first: bool) -> Any:
        g = grad.reshape(grad.size)
        bits = g.view(np.uint64)
        hi = np.uint64(0)
        for i in range(g.size):
            hi = max(hi, bits[i] & np.uint64(0x7FFFFFFFFFFFFFFF))
            q = np.rint(g[i] * scale)
            acc[i] = q + 0.0 if first else acc[i] + q  # + 0.0: as if acc started at +0.0
        out = np.empty(1, np.uint64)
        out[0] = hi
        return out.view(np.float64)[0]

    quantize_add: dict[Any, Callable[..., Any]] = {
        np.dtype(np.float32): quantize_add32,
        np.dtype(np.float64): quantize_add64,
    }

    @jit
    def count(peaks: Any, scales: Any, limit: float, given: Any, tail: Any, step_max: Any) -> None:
        n_t = peaks.size
        bad = over = False
        for t in range(n_t):
            p = peaks[t]
            if not np.isfinite(p):
                bad = True
            elif p * scales[t] > limit:
                over = True
        tail[0] += 1.0 if over and not bad else 0.0
        tail[1] += 1.0 if bad else 0.0
        for t in range(n_t):
            p = peaks[t]
            finite = np.isfinite(p)
            tail[2 + t] += 0.0 if finite else 1.0
            tail[2 + n_t + t] += np.rint(min(p * scales[t], limit)) if finite else 0.0
            tail[2 + 2 * n_t + t] += given[t]
            m = step_max[t]
            step_max[t] = p if (p != p or p > m) and m == m else m

    @jit
    def divide(src: Any, d: float, dst: Any) -> None:
        out = dst.reshape(dst.size)
        for i in range(src.size):
            out[i] = src[i] / d

    return quantize_add, count, divide


def _load(variants: set[tuple[int, torch.dtype]]) -> None:
    """Compile, or load from numba's cache, the kernels for tensors of these (ndim, dtype)."""
    quantize_add, count, divide = _compile()
    for ndim, dtype in variants:
        one = torch.ones((1,) * ndim, dtype=dtype).numpy()
        acc = np.zeros(1)
        for first in (False, True):
            quantize_add[one.dtype](one, one.dtype.type(1.0), acc, first)
        divide(acc, 1.0, one)
    count(np.zeros(1), np.ones(1), 1.0, np.ones(1), np.zeros(5), np.zeros(1))


def preload(max_ndim: int = 4) -> None:
    """Load the kernels for float32 and float64 tensors of 1 to `max_ndim` dimensions ahead
    of any reducer (a warm spare does, so the worker it becomes finds them loaded); nothing
    without numba."""
    if available():
        _load({(n, d) for n in range(1, max_ndim + 1) for d in KERNEL_DTYPES})


def _array(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of `t` (a copy when `t` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return (t.detach() if t.requires_grad else t).numpy()


class CpuKernels:
    """The fused loops for one reducer, over numpy views of its float64 buffer.

    `handles(i)` says whether tensor i goes through the kernels (float32 and float64); the
    reducer does the others with tensor ops. `offsets[i]` is where tensor i's integers
    start in the buffer's data region.
    """

    def __init__(
        self, specs: Sequence[tuple[torch.Size, torch.dtype]], offsets: Sequence[int]
    ) -> None:
        self._quantize_add, self._count, self._divide = _compile()
        self._mine = [d in KERNEL_DTYPES for _, d in specs]
        self._offsets = list(offsets)
        # Compile (or load from numba's cache) every variant the steps will call, now.
        _load({(len(s), d) for s, d in specs if d in KERNEL_DTYPES})

    def handles(self, i: int) -> bool:
        return self._mine[i]

    def quantize_add(
        self, i: int, grad: torch.Tensor, scale: float, data: np.ndarray, first: bool
    ) -> float:
        """data[tensor i] += round(grad * scale) in grad's dtype (with `first`, = instead of
        +=); returns max |grad| (nan if any element is nan, else inf if any is inf)."""
        g = _array(grad)
        if g.size == 0:
            return 0.0
        lo = self._offsets[i]
        kernel = self._quantize_add[g.dtype]
        return float(kernel(g, g.dtype.type(scale), data[lo : lo + g.size], first))

    def count(
        self,
        peaks: np.ndarray,
        scales: np.ndarray,
        limit: float,
        given: np.ndarray,
        tail: np.ndarray,
        step_max: np.ndarray,
    ) -> None:
        """Add the micro-batch's flags, quantized peaks and presence to the tail and fold
        its peaks into the step's running max (nan kept), as the tensor-op path does."""
        self._count(peaks, scales, limit, given, tail, step_max)

    def divide(self, i: int, data: np.ndarray, d: float, out: torch.Tensor) -> None:
        """out = data[tensor i] / d: float64 division, then rounded to out's dtype. `out`
        must be contiguous (it is written through a view)."""
        if not out.is_contiguous():
            raise ValueError("divide needs a contiguous output tensor")
        lo = self._offsets[i]
        self._divide(data[lo : lo + out.numel()], d, out.numpy())

    def set_grads(
        self,
        reduced: torch.Tensor,
        divisors: Sequence[float],
        params: Sequence[torch.Tensor],
        given: Sequence[int],
    ) -> None:
        """grad_t = reduced[t] / divisors[t] rounded to the param's dtype, for each tensor
        some micro-batch gave (None for the others): the kernel for float32/float64 into a
        contiguous grad, float64 tensor ops for the rest (the same arithmetic)."""
        data = reduced.numpy()
        grads: dict[int, torch.Tensor] = {}
        for i, count in enumerate(given):
            if count <= 0:
                continue  # no micro-batch gave one: .grad stays None
            out = grads[i] = torch.empty_like(params[i])
            if self.handles(i) and out.is_contiguous():
                self.divide(i, data, divisors[i], out)
            else:
                lo = self._offsets[i]
                out.copy_((reduced[lo : lo + out.numel()] / divisors[i]).view(out.shape))
        for p in params:
            p.grad = None
        for i, g in grads.items():
            params[i].grad = g
