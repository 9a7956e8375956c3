"""EXACT mode: fixed-point accumulation in float64 integers, bit-identical for any grouping
of micro-batches onto ranks and any order of combining their partial sums.

Where it sits: `make_reducer` (reduce.py) builds an `ExactReducer` for `ReduceMode.EXACT`;
`Step` drives it through the `Reducer` protocol (reduce_base.py). Shared checks and the
`.grad` write-back come from `ParamLayout`.

Float addition is not associative, so every micro-batch gradient g of tensor t is quantized
to fixed point, q = round_half_even(g * 2**k_t), and integers are summed. All ranks use the
same exponents k_t, so q depends only on the micro-batch. The integers are held in float64:
every partial sum of any subset of micro-batches is an integer of magnitude <= 2**53, which
float64 represents exactly, so each addition (here and in the all-reduce) is exact and any
grouping and order give the same bits. Then grad = sum / (n_micro * 2**k_t), cast to the
parameter dtype (a weighted mean: sum / (total weight * 2**k_t), weights.py). float64
rather than int64: the same bytes on the wire, one conversion pass fewer per micro-batch
and none at the end, for 9 bits less range (with 12 micro-batches and the default
headroom, a tensor's peak gradient keeps 41 bits, float32 has 24).

Why the quantization is exact and the same on every device: g * 2**k is exact in the
compute dtype (float64 for float64 parameters, float32 for float32/bfloat16/float16, which
float32 holds exactly) unless it is a subnormal; k is clamped so that a subnormal product
is < 0.5 and rounds to 0 whatever the hardware does with subnormals, and 2**k stays a
normal number. q is an integer held exactly in the compute dtype, and so in float64.

Limits: |q| <= LIMIT = 2**limit_bits, the largest power of two with n_micro * LIMIT <= 2**53,
so no partial sum of any subset of micro-batches leaves float64's exact integers. A power of
two (not 2**53 // n_micro) keeps LIMIT exact, where the overflow test runs.

Exponents: k_t = limit_bits - headroom_bits - ceil(log2 peak_t), where peak_t is the mean
over the previous committed step's micro-batches of max |g| of tensor t. The mean of the
per-micro-batch peaks (rather than max |averaged grad|, which cancellation can make far
smaller) tracks what overflow depends on; its integer sum rides in the same buffer. The
first step covers |g| <= initial_max. All of this comes from all-reduced integers, so every
rank computes the same k_t.

Overflow is decided per micro-batch from its exact peaks: it overflows if any
max |g_t| * 2**k_t > LIMIT, or it is non-finite. Such a micro-batch is counted in the
buffer's tail and its data may leave arbitrary integers in the data region; that is
harmless because `finish` never reads the data of a step with a count > 0. On overflow the
caller all-reduces MAX of `retry_max_buffer()` (per-tensor max |g| over the step), calls
`set_retry_exponents` (exponents that fit that max exactly, so the retry cannot overflow)
and recomputes the step. Non-finite gradients cannot be fixed by rescaling: `finish`
returns ReduceNonFinite naming the tensors. Both decisions depend only on the set of
micro-batch gradients, never on who computed them.

Buffer layout (float64, integer values): [data (all tensors, float32-computed first) |
overflowing micro-batches | non-finite micro-batches | per tensor: non-finite count,
quantized peak sum, micro-batches that gave a gradient | the caller's slots (see
`Reducer.buffer`)]. A tensor no micro-batch gave a gradient keeps `.grad = None`, as plain
PyTorch would leave it.
Nothing syncs with the host per micro-batch; `finish` reads the tail once.

Paths (same bits, checked in tests/elastic/test_reduce_kernels.py, test_reduce_device.py and
test_reduce_graph.py): off the CPU, fused quantize-and-accumulate in torch ops
(reduce_device.py; compiled on CUDA, a micro-batch that gives every tensor's gradient is one
call for all of them, reduce_graph.py, others a call per tensor); on the CPU, numba's
one-pass loops for float32/float64 (reduce_kernels.py) and tensor ops through
float32/float64 scratch buffers for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from keepstep.elastic import reduce_kernels
from keepstep.elastic.errors import ConfigError, StateShapeError
from keepstep.elastic.reduce_base import (
    ParamLayout,
    ReduceDone,
    ReduceMode,
    ReduceNonFinite,
    ReduceOutcome,
    ReduceOverflow,
    Settled,
    abs_max,
    check_caller_slots,
    check_exact_paths,
    check_exact_range,
    check_exact_state,
    check_total_weight,
    nonfinite_reason,
)
from keepstep.elastic.reduce_device import DeviceOps

# Clamp of k per compute dtype: 2**k normal, subnormal products < 0.5, and
# n_micro * 2**k finite in float64 for the final division.
_K_RANGE = {torch.float32: (-126, 125), torch.float64: (-1022, 960)}


def _ceil_log2(x: float) -> int:
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent - 1 if mantissa == 0.5 else exponent


class ExactReducer:
    """Fixed-point accumulation (integers in float64) with agreed per-tensor power-of-two
    scales.

    `device_ops` picks the fused torch ops (reduce_device.py: one compiled call per
    micro-batch where it can, else per tensor; `compile` as there); the default uses them
    off the CPU. `kernels` picks the one-pass CPU loops (reduce_kernels.py) for float32 and
    float64 parameters; the default uses them on the CPU when numba is installed. Otherwise
    tensor ops through scratch buffers, `fused` picking multi-tensor (foreach) kernels. All
    paths give the same bits.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        n_micro: int,
        headroom_bits: int = 8,
        initial_max: float = 2.0**16,
        fused: bool | None = None,
        kernels: bool | None = None,
        device_ops: bool | None = None,
        compile: bool | None = None,
    ) -> None:
        layout = ParamLayout(params, n_micro)
        on_cpu = layout.device.type == "cpu"
        self._fused = not on_cpu if fused is None else fused
        use_dev = not on_cpu if device_ops is None else device_ops
        check_exact_paths(layout.device, device_ops, kernels, compile)
        self.limit_bits = 53 - (n_micro - 1).bit_length()
        check_exact_range(self.limit_bits, n_micro, headroom_bits, initial_max)
        self.mode = ReduceMode.EXACT
        self._layout, self._headroom = layout, headroom_bits
        self._limit = float(2**self.limit_bits)
        dev, n_t, numels = layout.device, len(layout.specs), layout.numels
        self._compute = [
            torch.float64 if d == torch.float64 else torch.float32 for _, d in layout.specs
        ]
        wide = [i for i in range(n_t) if self._compute[i] == torch.float64]
        n = sum(numels)
        self._n, self._n32 = n, n - sum(numels[i] for i in wide)
        self._end, self._callers = n + 2 + 3 * n_t, 1  # the caller's slots: [_end:]
        self._acc = self._tail = torch.empty(0)
        self.abandon_buffer()
        self._n_t, self._lo = n_t, self._offsets()
        use = on_cpu and not use_dev and reduce_kernels.available() if kernels is None else kernels
        self._kernels = reduce_kernels.CpuKernels(layout.specs, self._lo) if use else None
        self._device = (
            DeviceOps(layout.specs, self._lo, dev, compile, buffer=self._acc) if use_dev else None
        )
        if self._device is None:
            self._make_scratch()
        self._step_max = torch.zeros(n_t, dtype=torch.float64, device=dev)
        self._step_max_np = self._step_max.numpy() if on_cpu else None
        self._zero = torch.zeros((), dtype=torch.float64, device=dev)
        self._peak = [0.0] * n_t  # mean micro-batch peak |g| of the last committed step
        k0 = self.limit_bits - _ceil_log2(initial_max)
        self._initial = [self._clamp(i, k0) for i in range(n_t)]
        self._set_exponents(list(self._initial))

    def _offsets(self) -> list[int]:
        """Where each tensor's integers start: the float32-computed block, then float64."""
        at, out = {torch.float32: 0, torch.float64: self._n32}, []
        for i, numel in enumerate(self._layout.numels):
            out.append(at[self._compute[i]])
            at[self._compute[i]] += numel
        return out

    def _make_scratch(self) -> None:
        """The tensor-op path's buffers: quantized values per compute dtype, widened copy."""
        n, dev, layout = self._n, self._layout.device, self._layout
        self._f32 = torch.empty(self._n32, dtype=torch.float32, device=dev)
        self._f64 = torch.empty(n - self._n32, dtype=torch.float64, device=dev)
        # The float32 block widened for the sum; in `finish`, the averaged gradients.
        self._wide = out = torch.empty(n, dtype=torch.float64, device=dev)
        self._qviews, self._oviews = [], []
        for i, (shape, _) in enumerate(layout.specs):
            lo, numel = self._lo[i], layout.numels[i]
            at = lo - (self._n32 if self._compute[i] == torch.float64 else 0)
            quant = self._f32 if self._compute[i] == torch.float32 else self._f64
            self._qviews.append(quant[at : at + numel].view(shape))
            self._oviews.append(out[lo : lo + numel].view(shape))

    @property
    def path(self) -> str:
        """Which path adds the micro-batches (all give the same bits): "device-compiled",
        "device-eager", "cpu-kernels" or "tensor-ops"."""
        if self._device is not None:
            return "device-compiled" if self._device.compiled else "device-eager"
        return "tensor-ops" if self._kernels is None else "cpu-kernels"

    @property
    def exponents(self) -> tuple[int, ...]:
        """k_t of the step in progress: q = round(g * 2**k_t)."""
        return tuple(self._k)

    def _clamp(self, i: int, k: int) -> int:
        lo, hi = _K_RANGE[self._compute[i]]
        return min(max(k, lo), hi)

    def _set_exponents(self, ks: list[int]) -> None:
        self._k = ks
        self._scales = [2.0**k for k in ks]
        self._scale_vec = torch.tensor(self._scales, dtype=torch.float64, device=self._acc.device)
        if self._device is not None:
            self._device.set_scales(self._scale_vec)

    def abandon_buffer(self) -> None:
        # Tail: overflowing, non-finite micro-batches; per tensor: non-finite, peak, given.
        size, dev = self._end + self._callers, self._layout.device
        self._acc = torch.zeros(size, dtype=torch.float64, device=dev)
        self._tail = self._acc[self._n : self._end]
        self._acc_np = self._acc.numpy() if self._acc.device.type == "cpu" else None
        self._unwritten = False  # kernels only: the data region is stale until written

    def set_caller_slots(self, count: int) -> None:
        if check_caller_slots(count) != self._callers:
            self._callers = count
            self.abandon_buffer()

    def begin_step(self) -> None:
        if self._kernels is not None:
            # The first micro-batch writes the data region instead of adding to it.
            self._acc[self._n :].zero_()
            self._unwritten = True
        else:
            self._acc.zero_()
        self._step_max.zero_()

    def add_micro_batch(self, grads: Sequence[torch.Tensor | None]) -> None:
        given = self._layout.present(grads)
        if self._kernels is not None:
            self._add_with_kernels(self._kernels, given)
            return
        if self._device is not None:
            peaks = self._device.add(given, self._acc)
            self._count(peaks, self._layout.mask(given, torch.float64))
            torch.maximum(self._step_max, peaks, out=self._step_max)
            return
        live = [(i, g) for i, g in given if g.numel()]
        n_t = self._n_t
        if len(live) == n_t:
            views, scales, tensors = self._qviews, self._scales, [g for _, g in live]
            peaks = abs_max(tensors, self._fused)
        else:  # absent gradients count as zeros
            index = [i for i, _ in live]
            torch._foreach_zero_([v for i, v in enumerate(self._qviews) if i not in index])
            views = [self._qviews[i] for i in index]
            scales = [self._scales[i] for i in index]
            tensors = [g for _, g in live]
            found = (
                dict(zip(index, abs_max(tensors, self._fused).unbind(), strict=True))
                if live
                else {}
            )
            peaks = torch.stack([found.get(i, self._zero) for i in range(n_t)])
        self._count(peaks, self._layout.mask(given, torch.float64))
        torch.maximum(self._step_max, peaks, out=self._step_max)
        if not live:
            return
        if not self._fused:
            for g, v, s in zip(tensors, views, scales, strict=True):
                if g.dtype == v.dtype:
                    torch.mul(g, s, out=v)
                else:  # float16 would overflow before the widening cast
                    v.copy_(g).mul_(s)
        else:  # few kernel launches matter more than one extra pass on accelerators
            torch._foreach_copy_(views, tensors)
            torch._foreach_mul_(views, scales)
        n, n32 = self._n, self._n32
        if n32:
            wide = self._wide[:n32]
            wide.copy_(self._f32.round_())  # exact: the float32 values are integers now
            self._acc[:n32].add_(wide)
        if n > n32:
            self._acc[n32:n].add_(self._f64.round_())

    def _add_with_kernels(
        self, kernels: reduce_kernels.CpuKernels, given: list[tuple[int, torch.Tensor]]
    ) -> None:
        n_t = self._n_t
        peaks, mask = np.zeros(n_t), np.zeros(n_t)
        assert self._acc_np is not None and self._step_max_np is not None
        data = self._acc_np[: self._n]
        first, self._unwritten = self._unwritten, False
        if first and len(given) < n_t:
            data.fill(0.0)  # absent gradients count as zeros
            first = False
        rest = []
        for i, g in given:
            mask[i] = 1.0
            if kernels.handles(i):
                peaks[i] = kernels.quantize_add(i, g, self._scales[i], data, first)
            elif g.numel():
                rest.append((i, g))
        if first and rest:  # not written by a kernel: start from zero
            for i, g in rest:
                data[self._lo[i] : self._lo[i] + g.numel()] = 0.0
        if rest:  # bfloat16, float16: widened to float32 first, as in the tensor path
            found = abs_max([g for _, g in rest], fused=False).tolist()
            for (i, g), peak in zip(rest, found, strict=True):
                peaks[i] = peak
                v = self._qviews[i]
                v.copy_(g).mul_(self._scales[i]).round_()
                self._acc[self._lo[i] : self._lo[i] + v.numel()].add_(v.reshape(-1))
        n = self._n
        tail = self._acc_np[n : self._end]
        kernels.count(peaks, self._scale_vec.numpy(), self._limit, mask, tail, self._step_max_np)

    def _count(self, peaks: torch.Tensor, given: torch.Tensor) -> None:
        """Add this micro-batch's flags, quantized peaks and presence to the tail."""
        scaled = peaks * self._scale_vec
        nonfinite = ~torch.isfinite(peaks)
        bad = nonfinite.any()
        over = (scaled > self._limit).any() & ~bad
        # <= LIMIT each, so n_micro of them fit; a bad micro-batch's peaks are never read.
        qpeak = torch.where(nonfinite, 0.0, scaled.clamp(max=self._limit)).round_()
        flags = torch.stack([over, bad]).to(torch.float64)
        self._tail.add_(torch.cat([flags, nonfinite.to(torch.float64), qpeak, given]))

    def buffer(self) -> torch.Tensor:
        if self._unwritten:  # no micro-batch this step: the data region is all zeros
            self._acc[: self._n].zero_()
            self._unwritten = False
        return self._acc

    def finish(
        self,
        reduced: torch.Tensor,
        n_micro: int,
        params: Sequence[torch.Tensor],
        total_weight: int | None = None,
    ) -> ReduceOutcome:
        self._layout.check_finish(reduced, self._acc, n_micro, params)
        settled = self.settle(reduced[self._n : self._end], n_micro, total_weight)
        if not isinstance(settled, Settled):
            return settled
        divisors, given = settled.divisors, settled.given
        if self._kernels is not None:
            self._kernels.set_grads(reduced, divisors, params, given)
        elif self._device is not None:
            self._device.set_grads(reduced, divisors, params, given)
        else:
            self._wide.copy_(reduced[: self._n])
            torch._foreach_div_(self._oviews, list(divisors))
            self._layout.set_grads(params, self._oviews, given)
        return ReduceDone()

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each tensor's integers start in the buffer; then where its data ends."""
        return (*self._lo, self._n)

    def settle(
        self, tail: torch.Tensor, n_micro: int, total_weight: int | None = None
    ) -> ReduceOutcome | Settled:
        """The outcome of a step's summed tail (the buffer after its data, summed over
        members): overflow, non-finite, or the divisors (``grad = sum / divisor`` in
        float64, rounded to the parameter's dtype) and the exponents move on. The sum is
        divided by ``total_weight`` (the micro-batches' weights, summed: a weighted mean)
        where given, else by ``n_micro``."""
        n_t = self._n_t
        counts = [int(c) for c in tail[: self._end - self._n].tolist()]  # exact integers
        if counts[1] > 0:
            bad = [c > 0 for c in counts[2 : 2 + n_t]]
            reason = nonfinite_reason(f"{counts[1]} of {n_micro} micro-batches have", bad)
            return ReduceNonFinite(reason)
        if counts[0] > 0:
            return ReduceOverflow(micro_batches=counts[0])
        # n * 2**k is exact (n < 2**53), and dividing by it equals (sum / n) * 2**-k exactly.
        n = n_micro if total_weight is None else check_total_weight(total_weight)
        divisors = tuple(n * s for s in self._scales)
        given = tuple(counts[2 + 2 * n_t :])
        qpeak = counts[2 + n_t : 2 + 2 * n_t]
        self._peak = [q / (n_micro * s) for q, s in zip(qpeak, self._scales, strict=True)]
        self._set_exponents([self._next_exponent(i, p) for i, p in enumerate(self._peak)])
        return Settled(divisors, given)

    def _next_exponent(self, i: int, peak: float) -> int:
        if peak <= 0.0:  # no signal (all zero): fall back to the initial range
            return self._initial[i]
        return self._clamp(i, self.limit_bits - self._headroom - _ceil_log2(peak))

    def retry_max_buffer(self) -> torch.Tensor:
        return self._step_max.clone()

    def set_retry_exponents(self, reduced_max: torch.Tensor) -> None:
        n_t = self._n_t
        if reduced_max.shape != (n_t,) or not reduced_max.is_floating_point():
            raise StateShapeError(
                f"reduced_max is {reduced_max.dtype} {tuple(reduced_max.shape)}; "
                f"expected float64 ({n_t},)"
            )
        peaks = reduced_max.to(torch.float64).tolist()
        for i, m in enumerate(peaks):
            if not 0.0 <= m < math.inf:
                raise ConfigError(f"reduced_max[{i}]={m!r} must be finite and >= 0")
        # Exponents that fit this step's own peaks exactly: the retry cannot overflow.
        self._set_exponents(
            [
                self._clamp(i, self.limit_bits - _ceil_log2(m)) if m > 0 else k
                for i, (m, k) in enumerate(zip(peaks, self._k, strict=True))
            ]
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "exponents": torch.tensor(self._k, dtype=torch.int64),
            "peak": torch.tensor(self._peak, dtype=torch.float64),
            "limit_bits": torch.tensor(self.limit_bits, dtype=torch.int64),
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        ks, peaks = check_exact_state(state, self._n_t, self.limit_bits)
        if any(self._clamp(i, k) != k for i, k in enumerate(ks)):
            raise StateShapeError(f"reducer state exponents {ks} out of range")
        self._peak = peaks
        self._set_exponents(ks)
