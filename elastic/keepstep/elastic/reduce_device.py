"""Device-side exact reduction: fused quantize-and-accumulate in torch ops, one compiled call
per micro-batch (eager ops tensor by tensor when nothing is compiled).

Where it sits: `ExactReducer` (reduce_exact.py) hands each micro-batch to `DeviceOps` when
the parameters are off the CPU (or on the CPU when asked, which is how CPU CI tests this
path); on the CPU it otherwise uses the numba loops (reduce_kernels.py) or its own tensor
ops. All three give the same bits on the same inputs (tests/elastic/test_reduce_device.py,
and bench/gpu_check.py on a GPU).

Per gradient g of tensor t, with the agreed scale s = 2**k_t held in the compute dtype c
(float64 for float64 parameters, float32 otherwise):

    acc[t] += round_half_even(c(g) * s)     then widened to float64 and added
    peak_t  = max |g|                       nan if any element is nan, else inf if any is

Compiled (`torch.compile`, Inductor; by default on CUDA only), a micro-batch is one call
(reduce_graph.py): a graph over all the gradients (zeros standing in for absent ones), the
scale vector and one buffer view per tensor, for the job's static shapes, that reads each g
once for the sum and once for the peak and updates the float64 sum in place, with no
float32 scratch copy and no widened copy. Static sizes also let Inductor split the peaks'
reductions: over a dynamic size it runs one on a single thread block, ~1000x slower on an
H200. A compiled call per tensor cost ~0.25 ms of launches and guards whatever the
tensor's size (31.9 ms for 112 tensors, slower than eager ops): hence one call for all.
Not compiled, eager ops run tensor by tensor.

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
import logging
from collections.abc import Sequence

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


class AddPath(enum.Enum):
    """How `DeviceOps.add` added a micro-batch (every way gives the same bits)."""

    GRAPH = "graph"  # all tensors in one compiled call (reduce_graph.py)
    GRAPH_EAGER = "graph-eager"  # that call's guards failed: its body ran eager (logged)
    PER_TENSOR = "per-tensor"  # eager ops tensor by tensor (not compiled)


class DeviceOps:
    """The fused path for one reducer: `add` quantizes one micro-batch into the buffer.

    `compile`: None compiles on CUDA and falls back to eager ops (logged) if that fails;
    True compiles or raises ConfigError with the reason; False runs eager ops. Compiled,
    every micro-batch is one call (`MicroBatchGraph`): a tensor it gave no gradient for
    goes in as zeros, which add +0.0 to a buffer that holds no -0.0 and peak at 0, as an
    absent one does. Eager, the ops run tensor by tensor. `last_path` says how the last
    micro-batch was added. The graph is compiled and warmed up here, writing +0.0 into
    `buffer` (the reducer's, all +0.0) if given, so no step pays for compilation.
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
        self._specs = list(specs)
        self._numels = [s.numel() for s, _ in specs]
        self._offsets = list(offsets)
        self._compute = [compute_dtype(d) for _, d in specs]
        self._device = device
        self._zero = torch.zeros((), dtype=torch.float64, device=device)
        self._scales: list[torch.Tensor] = []
        self._scale_vec = torch.ones(len(specs), dtype=torch.float64, device=device)
        self._zeros: dict[torch.dtype, torch.Tensor] = {}  # stand-ins for absent gradients
        self.last_path: AddPath | None = None
        self._graph: MicroBatchGraph | None = None
        want = device.type == "cuda" if compile is None else compile
        if want:
            try:
                self._graph = MicroBatchGraph(specs, offsets, device, acc=buffer)
            except Exception as e:  # the compiler's failures have no common type
                if compile:
                    raise ConfigError(f"compile=True but torch.compile failed: {e!r}") from e
                _log.warning("exact reduction runs eager torch ops: torch.compile failed: %r", e)

    @property
    def compiled(self) -> bool:
        """True when micro-batches go through the compiled graph."""
        return self._graph is not None

    def set_scales(self, scale_vec: torch.Tensor) -> None:
        """The step's per-tensor 2**k as a float64 vector on the device (exact in float32
        for the float32-computed tensors, whose k the reducer clamps to float32's range).
        The graph takes the vector; only the eager path needs one scale tensor a tensor."""
        self._scale_vec = scale_vec
        if self._graph is not None:
            return
        wide, narrow = scale_vec.unbind(), scale_vec.to(torch.float32).unbind()
        self._scales = [
            wide[i] if c == torch.float64 else narrow[i] for i, c in enumerate(self._compute)
        ]

    def add(self, given: Sequence[tuple[int, torch.Tensor]], acc: torch.Tensor) -> torch.Tensor:
        """Add each given gradient's integers to `acc` (the data region must start the step
        at +0.0); returns the per-tensor peaks, 0 for absent and empty ones. `given` holds
        (index, gradient) in index order, each index once, as ParamLayout.present gives."""
        if self._graph is None:
            return self.add_per_tensor(given, acc)
        grads = [g for _, g in given]
        if len(grads) != len(self._numels):
            grads = self._with_zeros(given)
        peaks, compiled = self._graph(grads, self._scale_vec, acc)
        self.last_path = AddPath.GRAPH if compiled else AddPath.GRAPH_EAGER
        return peaks

    def _with_zeros(self, given: Sequence[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """Every tensor's gradient, a zero view for the absent ones: views of one zero block
        per dtype, as large as the largest absent tensor of that dtype so far (an unused
        bias does not cost an embedding's worth of memory)."""
        have = dict(given)
        full = []
        for i, (shape, dtype) in enumerate(self._specs):
            g = have.get(i)
            if g is None:
                n = self._numels[i]
                block = self._zeros.get(dtype)
                if block is None or block.numel() < n:
                    block = torch.zeros(n, dtype=dtype, device=self._device)
                    self._zeros[dtype] = block
                g = block[:n].view(shape)
            full.append(g)
        return full

    def add_per_tensor(
        self, given: Sequence[tuple[int, torch.Tensor]], acc: torch.Tensor
    ) -> torch.Tensor:
        """`add` in eager ops, tensor by tensor (the path when nothing is compiled)."""
        self.last_path = AddPath.PER_TENSOR
        peaks = [self._zero] * len(self._numels)
        with torch.no_grad():
            for i, g in given:
                n, lo = self._numels[i], self._offsets[i]
                if n:
                    peaks[i] = quantize_add(g, self._scales[i], acc[lo : lo + n])
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
