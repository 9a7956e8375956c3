"""Tests of keepstep.elastic.reduce_kernels: the fused CPU loops give the tensor-op path's
bits, micro-batch by micro-batch, for clean, overflowing and non-finite gradients.

(tests/elastic/test_reduce.py runs every multi-rank case with both paths side by side.)
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from keepstep.elastic import reduce_kernels
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.reduce import ExactReducer, ReduceDone, ReduceNonFinite, ReduceOverflow

N_MICRO = 4
K0 = 51 - 16  # the first step's exponent: 53 - bit_length(N_MICRO - 1) bits, |g| <= 2**16


def make_params() -> list[torch.Tensor]:
    return [
        torch.zeros(5, 3),
        torch.zeros(7, dtype=torch.float64),
        torch.zeros(2, 3, dtype=torch.bfloat16),
        torch.zeros(0),
        torch.zeros(4, 6).t(),  # not contiguous: its gradient comes back through tensor ops
    ]


def grads(mb: int, scale: float = 1.0, poison: float | None = None) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(mb)
    out: list[torch.Tensor | None] = []
    for i, p in enumerate(make_params()):
        if i == 3 and mb % 2:
            out.append(None)
            continue
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
        # A tie at the rounding step: (mb + 1/2) once scaled by the first step's 2**k.
        g.view(-1)[:1] = (mb + 0.5) * 2.0**-K0
        g = g.to(p.dtype)
        if i == 4:
            g = torch.randn(4, 6, generator=gen).t()  # a transposed, non-contiguous gradient
        out.append(g)
    if poison is not None:
        first = out[0]
        assert first is not None
        first[1, 2] = poison
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in element order, for a bit-for-bit comparison of any dtype."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("scale", "poison"),
    [(1.0, None), (1e-6, None), (1e30, None), (1.0, math.nan), (1.0, math.inf), (1.0, -math.inf)],
)
def test_each_micro_batch_leaves_the_same_buffer_as_the_tensor_path(
    scale: float, poison: float | None
) -> None:
    fused = ExactReducer(make_params(), N_MICRO, kernels=True)
    plain = ExactReducer(make_params(), N_MICRO, kernels=False)
    n = fused.buffer().numel() - 3 - 3 * len(make_params())
    for r in (fused, plain):
        r.begin_step()
    for mb in range(N_MICRO):
        g = grads(mb, scale, poison if mb == 2 else None)
        fused.add_micro_batch(g)
        plain.add_micro_batch(g)
        a, b = fused.buffer(), plain.buffer()
        # The tail (flags, peaks, presence) always; the data while every micro-batch so far
        # was finite (after a non-finite one the data is never read).
        assert torch.equal(bits(a[n:]), bits(b[n:])), f"tail differs after micro-batch {mb}"
        if poison is None or mb < 2:
            assert torch.equal(bits(a[:n]), bits(b[:n])), f"data differs after micro-batch {mb}"
        assert torch.equal(
            bits(fused.retry_max_buffer()).nan_to_num(), bits(plain.retry_max_buffer()).nan_to_num()
        )


def test_finish_gives_the_same_grads_and_next_exponents() -> None:
    pa, pb = make_params(), make_params()
    fused, plain = ExactReducer(pa, N_MICRO, kernels=True), ExactReducer(pb, N_MICRO, kernels=False)
    for step in range(3):
        for r, params in ((fused, pa), (plain, pb)):
            r.begin_step()
            for mb in range(N_MICRO):
                r.add_micro_batch(grads(mb + 10 * step, 10.0**step))
            assert isinstance(r.finish(r.buffer(), N_MICRO, params), ReduceDone)
        for x, y in zip(pa, pb, strict=True):
            assert (x.grad is None) == (y.grad is None)
            if x.grad is not None and y.grad is not None:
                assert x.grad.dtype == y.grad.dtype and x.grad.stride() == y.grad.stride()
                assert torch.equal(raw(x.grad), raw(y.grad))
        assert fused.exponents == plain.exponents


def test_overflow_and_non_finite_outcomes_match() -> None:
    for scale, poison, want in ((1e30, None, ReduceOverflow), (1.0, math.nan, ReduceNonFinite)):
        pa, pb = make_params(), make_params()
        outcomes = []
        for kernels, params in ((True, pa), (False, pb)):
            r = ExactReducer(params, N_MICRO, kernels=kernels)
            r.begin_step()
            for mb in range(N_MICRO):
                r.add_micro_batch(grads(mb, scale, poison if mb == 1 else None))
            outcomes.append(r.finish(r.buffer(), N_MICRO, params))
        assert all(isinstance(o, want) for o in outcomes)
        assert outcomes[0] == outcomes[1]


def test_the_default_uses_the_kernels_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = reduce_kernels.CpuKernels.quantize_add

    def counting(self: reduce_kernels.CpuKernels, i: int, *args: Any) -> float:
        calls.append(i)
        return real(self, i, *args)

    monkeypatch.setattr(reduce_kernels.CpuKernels, "quantize_add", counting)
    params = make_params()
    r = ExactReducer(params, N_MICRO)
    r.begin_step()
    r.add_micro_batch(grads(0))
    # float32, float64, the empty float32 and the transposed float32; bfloat16 takes ops.
    assert sorted(calls) == [0, 1, 3, 4]


def test_kernels_without_numba_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduce_kernels, "available", lambda: False)
    with pytest.raises(ConfigError, match="numba"):
        ExactReducer(make_params(), N_MICRO, kernels=True)
    r = ExactReducer(make_params(), N_MICRO)  # the default falls back to tensor ops
    r.begin_step()
    r.add_micro_batch(grads(0))


def test_a_step_without_micro_batches_sends_zeros_after_one_with_them() -> None:
    """A rank left idle by a new plan must not send the last step's sums again."""
    params = make_params()
    fused, plain = (ExactReducer(params, N_MICRO, kernels=k) for k in (True, False))
    for r in (fused, plain):
        r.begin_step()
        for mb in range(N_MICRO):
            r.add_micro_batch(grads(mb))
        assert isinstance(r.finish(r.buffer(), N_MICRO, params), ReduceDone)
        r.begin_step()  # the next step brings no micro-batch to this rank
    assert not fused.buffer().any()
    assert torch.equal(bits(fused.buffer()), bits(plain.buffer()))


def test_preload_loads_every_variant_before_any_reducer() -> None:
    # A fresh process, so nothing another test ran has loaded them already.
    code = (
        "import numpy as np\n"
        "from keepstep.elastic import reduce_kernels as rk\n"
        "rk.preload(3)\n"
        "q = rk._compile()[0]\n"
        "sigs = [(str(t), s) for t in q for s in q[t].signatures]\n"
        "print(sorted({(t, s[0].ndim) for t, s in sigs}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert loaded == [(t, n) for t in ("float32", "float64") for n in (1, 2, 3)]
