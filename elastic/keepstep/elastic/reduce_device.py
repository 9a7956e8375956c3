"""Device-side exact reduction: one fused quantize-and-accumulate per tensor, in torch ops.

Where it sits: `ExactReducer` (reduce_exact.py) hands each micro-batch to `DeviceOps` when
the parameters are off the CPU (or on the CPU when asked, which is how CPU CI tests this
path); on the CPU it otherwise uses the numba loops (reduce_kernels.py) or its own tensor
ops. All three give the same bits on the same inputs (tests/elastic/test_reduce_device.py,
and bench/gpu_check.py on a GPU).

Per gradient g of tensor t, with the agreed scale s = 2**k_t held in the compute dtype c
(float64 for float64 parameters, float32 otherwise):

    acc[t] += round_half_even(c(g) * s)     then widened to float64 and added
    peak_t  = max |g|                       nan if any element is nan, else inf if any is

The sum is one compiled pointwise kernel (`torch.compile`, Inductor on CUDA): it reads g
once and updates the float64 sum in place, with no float32 scratch copy and no widened
copy. The peak is one eager reduction (aminmax): Inductor compiles a reduction over a
dynamic size to run on one thread block, ~1000x slower than a split one on an H200. Why the bits do
not depend on the device or on compilation: c(g) is exact (float32 holds every bfloat16 and
float16 value), the product by a power of two is exact unless it is subnormal, and the
reducer clamps k so that a subnormal product is < 0.5 and rounds to a zero of the same sign
whether or not the hardware flushes it; the rounded value is an integer, so widening and
adding it to float64 integers is exact too. The buffer starts each step at +0.0 and is only
added to, so a -0.0 never survives into it (the sign of zero is part of the bits).

The division in `finish` stays eager on purpose: torch's eager float64 division is correctly
rounded on every device, and a compiler may turn x / d into x * (1 / d), which is not.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence

import torch

from keepstep.elastic.errors import ConfigError

__all__ = ["DeviceOps", "quantize_add"]

_log = logging.getLogger(__name__)


def accumulate(grad: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += round_half_even(grad * scale) in `scale`'s dtype: the part that is compiled.

    `grad` flat and non-empty; `scale` a 0-dim float32 or float64 tensor holding a power
    of two; `acc` a 1-D float64 view of grad.numel() elements."""
    acc.add_(torch.round(grad.to(scale.dtype) * scale))


def peak(grad: torch.Tensor) -> torch.Tensor:
    """max |grad| as a 0-dim float64 tensor (nan if any element is nan, else inf if any is):
    the larger magnitude of the min and the max, in one pass and no |grad| temporary
    (aminmax and maximum propagate nan). Eager on every path: Inductor runs a reduction
    over a dynamic size on one thread block (on an H200, 0.9 s for 67M elements against
    0.5 ms for the fused kernel compiled for the size: bench/reduce_device_cost.py)."""
    lo, hi = torch.aminmax(grad)
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float64)


def quantize_add(grad: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """acc += round_half_even(grad * scale) in `scale`'s dtype; returns max |grad| as a
    0-dim float64 tensor (nan if any element is nan, else inf if any is inf).

    `grad` is non-empty, any layout (read in row-major order); `scale` a 0-dim float32 or
    float64 tensor holding a power of two; `acc` a 1-D float64 view of grad.numel() elements.
    """
    x = grad.reshape(-1)
    accumulate(x, scale, acc)
    return peak(x)


# Dynamo specializes a tensor's storage offset of 0 or 1 (as it does sizes): a buffer view
# at offset 0, 1 and >= 2 are three graphs per dtype. Each class gets its own compiled copy
# of `accumulate` (own code object, so own cache and own limit of 8 graphs): with one graph
# per gradient dtype each, the four float dtypes never reach the limit, where one shared
# function would (a ninth graph with fullgraph is an error in the middle of a step).
Accumulate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
_OFFSET_CLASSES = ("0", "1", "n")


def offset_class(offset: int) -> int:
    """Which compiled copy takes a buffer view at this storage offset: 0, 1, or more."""
    return min(offset, 2)


@functools.cache
def _compiled(klass: int) -> Accumulate:
    """One compiled wrapper per process and offset class. Dynamic sizes and flat inputs:
    one graph per gradient dtype whatever the shapes and offsets of that class, as long as
    every call runs with grad mode off (grad mode is part of a graph's guards) and the
    gradient starts its storage (a view of a bucket goes eager)."""
    name = f"accumulate_at_{_OFFSET_CLASSES[klass]}"
    code = accumulate.__code__.replace(co_name=name, co_qualname=name)
    fn = types.FunctionType(code, accumulate.__globals__, name)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class DeviceOps:
    """The fused path for one reducer: `add` quantizes one micro-batch into the buffer.

    `compile`: None compiles on CUDA and falls back to eager ops (logged) if that fails;
    True compiles or raises ConfigError with the reason; False runs eager ops. Compilation
    is warmed up here, for every dtype the parameters use, so no step pays for it.
    """

    def __init__(
        self,
        specs: Sequence[tuple[torch.Size, torch.dtype]],
        offsets: Sequence[int],
        device: torch.device,
        compile: bool | None = None,
    ) -> None:
        if compile is not None and not isinstance(compile, bool):
            raise ConfigError(f"compile={compile!r} must be a bool or None")
        if len(specs) != len(offsets):
            raise ConfigError(f"{len(specs)} tensor specs but {len(offsets)} offsets")
        self._numels = [s.numel() for s, _ in specs]
        self._offsets = list(offsets)
        self._compute = [_compute_dtype(d) for _, d in specs]
        self._device = device
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._scales: list[torch.Tensor] = []
        self.compiled = False
        self._fns: tuple[Accumulate, ...] = ()
        want = device.type == "cuda" if compile is None else compile
        if want:
            try:
                fns = tuple(_compiled(k) for k in range(len(_OFFSET_CLASSES)))
                self._warm_up(fns, specs)
            except Exception as e:  # the compiler's failures have no common type
                if compile:
                    raise ConfigError(f"compile=True but torch.compile failed: {e!r}") from e
                _log.warning("exact reduction runs eager torch ops: torch.compile failed: %r", e)
            else:
                self._fns, self.compiled = fns, True

    def _warm_up(
        self, fns: Sequence[Accumulate], specs: Sequence[tuple[torch.Size, torch.dtype]]
    ) -> None:
        """Compile now each graph a step will use: per dtype, the offset classes its
        tensors' buffer views fall in (the buffer starts its storage), with grad mode off as
        in `add`. Other offsets (a buffer that is itself a view) compile at first use."""
        acc = torch.zeros(40, dtype=torch.float64, device=self._device)
        needed = {
            (d, offset_class(lo))
            for (_, d), n, lo in zip(specs, self._numels, self._offsets, strict=True)
            if n > 1
        }
        with torch.no_grad():
            for dtype, klass in sorted(needed, key=str):
                scale = torch.ones((), dtype=_compute_dtype(dtype), device=self._device)
                at = (0, 1, 3)[klass]
                grad = torch.ones(17, dtype=dtype, device=self._device)
                fns[klass](grad, scale, acc[at : at + 17])

    def set_scales(self, scale_vec: torch.Tensor) -> None:
        """The step's per-tensor 2**k as a float64 vector on the device (exact in float32
        for the float32-computed tensors, whose k the reducer clamps to float32's range)."""
        wide, narrow = scale_vec.unbind(), scale_vec.to(torch.float32).unbind()
        self._scales = [
            wide[i] if c == torch.float64 else narrow[i] for i, c in enumerate(self._compute)
        ]

    def add(self, given: Sequence[tuple[int, torch.Tensor]], acc: torch.Tensor) -> torch.Tensor:
        """Add each given gradient's integers to `acc` (the data region must start the step
        at +0.0); returns the per-tensor peaks, 0 for absent and empty ones."""
        peaks = [self._zero] * len(self._numels)
        with torch.no_grad():
            for i, g in given:
                n, lo = self._numels[i], self._offsets[i]
                if not n:
                    continue
                # Flat (a copy only if g is not contiguous). Size 1 and a gradient inside a
                # larger storage go eager: a dynamic graph would specialize them (more
                # graphs per dtype). Same bits either way.
                flat, view = g.reshape(-1), acc[lo : lo + n]
                fn: Accumulate = accumulate
                if self._fns and n > 1 and flat.storage_offset() == 0:
                    fn = self._fns[offset_class(int(view.storage_offset()))]
                fn(flat, self._scales[i], view)
                peaks[i] = peak(flat)
            return torch.stack(peaks)

    def set_grads(
        self,
        reduced: torch.Tensor,
        divisors: Sequence[float],
        params: Sequence[torch.Tensor],
        given: Sequence[int],
    ) -> None:
        """grad_t = (reduced[t] / divisors[t]) rounded to the param's dtype, for each tensor
        some micro-batch gave; None for the others, as plain PyTorch leaves them."""
        grads: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for i, count in enumerate(given):
                if count > 0:
                    lo, p = self._offsets[i], params[i]
                    out = grads[i] = torch.empty_like(p)
                    out.copy_((reduced[lo : lo + self._numels[i]] / divisors[i]).view(p.shape))
        for p in params:
            p.grad = None
        for i, g in grads.items():
            params[i].grad = g
