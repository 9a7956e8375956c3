"""Device-side exact reduction: fused quantize-and-accumulate in torch ops, one compiled call
per micro-batch where it can, else one per tensor.

Where it sits: `ExactReducer` (reduce_exact.py) hands each micro-batch to `DeviceOps` when
the parameters are off the CPU (or on the CPU when asked, which is how CPU CI tests this
path); on the CPU it otherwise uses the numba loops (reduce_kernels.py) or its own tensor
ops. All three give the same bits on the same inputs (tests/elastic/test_reduce_device.py,
and bench/gpu_check.py on a GPU).

Per gradient g of tensor t, with the agreed scale s = 2**k_t held in the compute dtype c
(float64 for float64 parameters, float32 otherwise):

    acc[t] += round_half_even(c(g) * s)     then widened to float64 and added
    peak_t  = max |g|                       nan if any element is nan, else inf if any is

Compiled (`torch.compile`, Inductor; by default on CUDA only), a micro-batch that gives every
tensor's gradient is one call (reduce_graph.py): a graph over all the gradients, the scale
vector and one buffer view per tensor, for the job's static shapes, that reads each g once
for the sum and once for the peak and updates the float64 sum in place. Otherwise (a
gradient absent, or not compiled) tensor by tensor: the sum one compiled pointwise kernel
for dynamic sizes (one graph per dtype), with no float32 scratch copy and no widened copy,
and the peak one eager reduction (aminmax): Inductor compiles a reduction over a dynamic
size to run on one thread block, ~1000x slower than a split one on an H200. A call per
tensor costs ~0.25 ms of launches and guards whatever its size, which is why the whole
micro-batch is one call when it can be.

Why the bits do not depend on the path, the device or on compilation: c(g) is exact
(float32 holds every bfloat16 and float16 value), the product by a power of two is exact
unless it is subnormal, and the reducer clamps k so that a subnormal product is < 0.5 and
rounds to a zero of the same sign whether or not the hardware flushes it; the rounded value
is an integer, so widening and adding it to float64 integers is exact too; max |g| is one
of g's values, and nan propagates through every max here (eager, and Inductor's reductions).
The buffer starts each step at +0.0 and is only added to, so a -0.0 never survives into it
(the sign of zero is part of the bits).

The division in `set_grads` stays eager on purpose: torch's eager float64 division is
correctly rounded on every device, and a compiler may turn x / d into x * (1 / d), which
is not.
"""

from __future__ import annotations

import enum
import functools
import logging
import types
from collections.abc import Callable, Sequence

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.reduce_graph import MicroBatchGraph, accumulate, compute_dtype, peak

__all__ = ["AddPath", "DeviceOps", "quantize_add"]

_log = logging.getLogger(__name__)


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


class AddPath(enum.Enum):
    """How `DeviceOps.add` added a micro-batch (every way gives the same bits)."""

    GRAPH = "graph"  # all tensors in one compiled call (reduce_graph.py)
    GRAPH_EAGER = "graph-eager"  # that call's guards failed: its body ran eager (logged)
    PER_TENSOR = "per-tensor"  # a call per tensor: compiled ones, or eager ops


class DeviceOps:
    """The fused path for one reducer: `add` quantizes one micro-batch into the buffer.

    `compile`: None compiles on CUDA and falls back to eager ops (logged) if that fails;
    True compiles or raises ConfigError with the reason; False runs eager ops. Compiled,
    a micro-batch that gives every tensor's gradient runs as one call (`MicroBatchGraph`),
    others tensor by tensor; `last_path` says which added the last one. Compilation is
    warmed up here, for every dtype the parameters use, so no step pays for it; the
    micro-batch graph's warm-up writes +0.0 into `buffer` (the reducer's, all +0.0) if given.
    """

    def __init__(
        self,
        specs: Sequence[tuple[torch.Size, torch.dtype]],
        offsets: Sequence[int],
        device: torch.device,
        compile: bool | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        if compile is not None and not isinstance(compile, bool):
            raise ConfigError(f"compile={compile!r} must be a bool or None")
        if len(specs) != len(offsets):
            raise ConfigError(f"{len(specs)} tensor specs but {len(offsets)} offsets")
        self._numels = [s.numel() for s, _ in specs]
        self._offsets = list(offsets)
        self._compute = [compute_dtype(d) for _, d in specs]
        self._device = device
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._scales: list[torch.Tensor] = []
        self._scale_vec = torch.ones(len(specs), dtype=torch.float64, device=device)
        self.compiled = False
        self.last_path: AddPath | None = None
        self._fns: tuple[Accumulate, ...] = ()
        self._graph: MicroBatchGraph | None = None
        want = device.type == "cuda" if compile is None else compile
        if want:
            try:
                fns = tuple(_compiled(k) for k in range(len(_OFFSET_CLASSES)))
                self._warm_up(fns, specs)
                graph = MicroBatchGraph(specs, offsets, device, acc=buffer)
            except Exception as e:  # the compiler's failures have no common type
                if compile:
                    raise ConfigError(f"compile=True but torch.compile failed: {e!r}") from e
                _log.warning("exact reduction runs eager torch ops: torch.compile failed: %r", e)
            else:
                self._fns, self._graph, self.compiled = fns, graph, True

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
                scale = torch.ones((), dtype=compute_dtype(dtype), device=self._device)
                at = (0, 1, 3)[klass]
                grad = torch.ones(17, dtype=dtype, device=self._device)
                fns[klass](grad, scale, acc[at : at + 17])

    def set_scales(self, scale_vec: torch.Tensor) -> None:
        """The step's per-tensor 2**k as a float64 vector on the device (exact in float32
        for the float32-computed tensors, whose k the reducer clamps to float32's range)."""
        self._scale_vec = scale_vec
        wide, narrow = scale_vec.unbind(), scale_vec.to(torch.float32).unbind()
        self._scales = [
            wide[i] if c == torch.float64 else narrow[i] for i, c in enumerate(self._compute)
        ]

    def add(self, given: Sequence[tuple[int, torch.Tensor]], acc: torch.Tensor) -> torch.Tensor:
        """Add each given gradient's integers to `acc` (the data region must start the step
        at +0.0); returns the per-tensor peaks, 0 for absent and empty ones. `given` holds
        (index, gradient) in index order, each index once, as ParamLayout.present gives."""
        if self._graph is not None and len(given) == len(self._numels):
            peaks, compiled = self._graph([g for _, g in given], self._scale_vec, acc)
            self.last_path = AddPath.GRAPH if compiled else AddPath.GRAPH_EAGER
            return peaks
        return self.add_per_tensor(given, acc)

    def add_per_tensor(
        self, given: Sequence[tuple[int, torch.Tensor]], acc: torch.Tensor
    ) -> torch.Tensor:
        """`add` tensor by tensor whatever was given (the compiled path's fallback)."""
        self.last_path = AddPath.PER_TENSOR
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
