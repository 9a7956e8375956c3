"""The exact reduction's device arithmetic, and a whole micro-batch of it in one compiled call.

Where it sits: `DeviceOps` (reduce_device.py) adds a micro-batch with these functions: when
its path is compiled, all tensors in one call of a `MicroBatchGraph` (zeros standing in for
absent gradients); otherwise eager, tensor by tensor. reduce_device.py says why the bits do
not depend on the path.

Why one call: a compiled per-tensor call cost ~0.25 ms of launches and dynamo guards
whatever its size (on an H200, 32 ms for a micro-batch of 112 tensors and 67M elements
against 0.29 ms for fp32 `_foreach_add_` of the same gradients).
The graph is compiled once per process for the job's shapes, which are fixed for its life:
static sizes, so Inductor also splits the peaks' reductions (over a dynamic size it runs one
on a single thread block). It is compiled and run once at construction, with grad mode off
as in a step, so no step pays for compilation.

How the buffer goes in (torch 2.15, read with TORCH_LOGS=output_code on the CPU). With the
whole buffer as one input and `acc[lo:hi].add_(...)` inside, functionalization makes a chain
of slice_scatter over the buffer, and Inductor lowers it to ONE loop over all of the buffer
with a nested masked select per tensor: in place, but every element tests every tensor's
range (work ~ tensors x buffer size). With one view per tensor as an input (here), each view
is a mutated input that Inductor updates in place, the same pointer passed in and out: no
copy of the buffer, no scatter. Views of one storage need no "synthetic base" as long as
they do not overlap. Per tensor, Inductor emits one loop for the sum and one reduction loop
for both ends of the peak's aminmax (not fused with the sum), all in one C++ function on
the CPU; `combo_kernels` changes nothing there (a Triton-only option): on CUDA each loop is
a kernel of its own (a split reduction likely two) unless combo kernels group them, which
bench/reduce_device_cost.py measures (`graph_kernels`, `graph_combo_kernels`).

Guards: the graph is compiled for contiguous gradients, so a gradient with other strides (a
transposed parameter's) is copied first, as the per-tensor path does. Anything else a guard
checks (grad mode, thread count, deterministic mode, a gradient that requires grad) would
make dynamo recompile in the middle of a step, and with fullgraph fail at its limit: the
call runs under the stance "eager_on_recompile", so the same body runs eager instead (the
same bits, slow, logged once), and the call says which ran.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["MicroBatchGraph", "accumulate", "compute_dtype", "peak"]

_log = logging.getLogger(__name__)

Spec = tuple[torch.Size, torch.dtype]


def accumulate(grad: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor) -> None:
    """acc += round_half_even(grad * scale) in `scale`'s dtype.

    `grad` flat and non-empty; `scale` a 0-dim float32 or float64 tensor holding a power
    of two; `acc` a 1-D float64 view of grad.numel() elements."""
    acc.add_(torch.round(grad.to(scale.dtype) * scale))


def peak(grad: torch.Tensor) -> torch.Tensor:
    """max |grad| as a 0-dim float64 tensor (nan if any element is nan, else inf if any is):
    the larger magnitude of the min and the max, in one pass and no |grad| temporary
    (aminmax and maximum propagate nan). Compiled only in the micro-batch graph, for static
    sizes: Inductor runs a reduction over a dynamic size on one thread block (on an H200,
    0.9 s for 67M elements against 0.5 ms compiled for the size)."""
    lo, hi = torch.aminmax(grad)
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient is scaled and rounded in: float32 holds every float16, bfloat16
    and float32 value exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate_all(
    grads: Sequence[torch.Tensor], scales: torch.Tensor, views: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, bool]:
    """`accumulate` and `peak` for every tensor of a micro-batch: the body of the graph.

    grads[t] any layout (read in row-major order); scales the step's float64 2**k_t;
    views[t] the float64 buffer view of tensor t. Returns the per-tensor peaks (0 for an
    empty tensor) and whether this ran compiled. No closure and no globals but functions,
    so the guards are the inputs' and the global state's only."""
    peaks = []
    for t, grad in enumerate(grads):
        flat = grad.reshape(-1)
        if flat.numel() == 0:  # static: decided when the graph is traced
            peaks.append(scales.new_zeros(()))
            continue
        accumulate(flat, scales[t].to(compute_dtype(grad.dtype)), views[t])
        peaks.append(peak(flat))
    return torch.stack(peaks), torch.compiler.is_compiling()


Body = Callable[
    [Sequence[torch.Tensor], torch.Tensor, Sequence[torch.Tensor]], tuple[torch.Tensor, bool]
]


@dataclass(frozen=True)
class GraphKey:
    """What a graph is compiled for: the tensors' shapes, dtypes and buffer offsets."""

    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    offsets: tuple[int, ...]
    device: torch.device
    combo_kernels: bool


@functools.cache
def _compiled(key: GraphKey) -> Body:
    """One compiled wrapper per process and key: its own code object, so its own cache and
    recompile limit (no other graph can use them up). It compiles at its first call."""
    name = "accumulate_micro_batch"
    code = accumulate_all.__code__.replace(co_name=name, co_qualname=name)
    body = types.FunctionType(code, accumulate_all.__globals__, name)
    options: dict[str, str | int | bool | Callable[..., object]] | None = None
    if key.combo_kernels:
        options = {"combo_kernels": True}
    fn: Body = torch.compile(body, fullgraph=True, dynamic=False, options=options)
    return fn


def _warm_up(fn: Body, key: GraphKey, acc: torch.Tensor | None) -> None:
    """Run the graph once on zeros shaped as a step's inputs, which compiles it unless this
    process has (and torch._dynamo.reset() has not dropped it since): contiguous gradients
    (views of one block per dtype: dynamo does not guard on gradients aliasing) and buffer
    views at the step's offsets (so at the step's alignment: Inductor copies an input that
    is less aligned than at compilation, and for a mutated input then copies it back).
    The views are of ``acc`` when given (the reducer's buffer, all +0.0, which adding
    round(0 * 1) leaves as it is): a model's second float64 data region would be 8 bytes
    a parameter of device memory, for the moment."""
    dev, specs = key.device, key.specs
    end = max((lo + _numel(s) for (s, _), lo in zip(specs, key.offsets, strict=True)), default=0)
    if acc is None or acc.numel() < end:
        acc = torch.zeros(end, dtype=torch.float64, device=dev)
    biggest: dict[torch.dtype, int] = {}
    for shape, dtype in specs:
        biggest[dtype] = max(biggest.get(dtype, 0), _numel(shape))
    blocks = {d: torch.zeros(n, dtype=d, device=dev) for d, n in biggest.items()}
    grads = [blocks[d][: _numel(s)].view(s) for s, d in specs]
    views = [acc[lo : lo + _numel(s)] for (s, _), lo in zip(specs, key.offsets, strict=True)]
    with torch.no_grad():
        fn(grads, torch.ones(len(specs), dtype=torch.float64, device=dev), views)


def _numel(shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel()


class MicroBatchGraph:
    """A whole micro-batch in one compiled call: for every tensor t,
    acc[lo_t : lo_t + n_t] += round_half_even(c_t(g_t) * 2**k_t), and the peaks.

    Built for the reducer's tensor specs and buffer offsets; compiles (once per process for
    these) and runs once, into `acc` if given (a +0.0 float64 buffer, left so), and raises
    what the compiler raised if that fails. `combo_kernels` compiles with Inductor's combo
    kernels (an option of this compilation only)."""

    def __init__(
        self,
        specs: Sequence[Spec],
        offsets: Sequence[int],
        device: torch.device,
        combo_kernels: bool = False,
        acc: torch.Tensor | None = None,
    ) -> None:
        self._numels = [s.numel() for s, _ in specs]
        self._offsets = list(offsets)
        # The warm-up's gradients' strides, which the graph's guards hold gradients to.
        self._strides = [_contiguous(s) for s, _ in specs]
        key = GraphKey(
            tuple((tuple(s), d) for s, d in specs), tuple(offsets), device, combo_kernels
        )
        self._fn = _compiled(key)
        _warm_up(self._fn, key, acc)
        self._acc: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._warned = False

    def __call__(
        self, grads: Sequence[torch.Tensor], scales: torch.Tensor, acc: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """Add every tensor's gradient (shapes and dtypes as built for) into `acc`, the
        reducer's buffer; returns the per-tensor peaks and whether the compiled graph ran
        (else its body ran eager: a guard failed)."""
        if acc is not self._acc:  # a new buffer: views of it, kept for the next calls
            self._acc = acc
            spans = zip(self._offsets, self._numels, strict=True)
            self._views = [acc[lo : lo + n] for lo, n in spans]
        grads = [
            g if g.stride() == want else g.clone(memory_format=torch.contiguous_format)
            for g, want in zip(grads, self._strides, strict=True)
        ]
        with torch.no_grad(), torch.compiler.set_stance("eager_on_recompile"):
            peaks, compiled = self._fn(grads, scales, self._views)
        if not compiled and not self._warned:
            self._warned = True
            _log.warning(
                "exact reduction: the micro-batch graph's guards failed (grad mode, thread "
                "count, deterministic mode or a gradient's layout differs from its "
                "compilation, or torch._dynamo.reset() dropped it): it runs eager"
            )
        return peaks, compiled


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
