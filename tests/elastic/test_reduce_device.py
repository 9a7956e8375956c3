"""Tests of keepstep.elastic.reduce_device: the fused torch ops (the path used off the CPU,
run here on CPU tensors, eager) give the bits of the numba kernels and of the tensor-op
path, micro-batch by micro-batch and after `finish`, for any mix of dtypes, layouts, absent
gradients, ties, subnormals, signed zeros, overflow (and its retry) and non-finite values.

Compiled, a micro-batch is one call of a graph: test_reduce_graph.py compiles it on the CPU,
and bench/gpu_check.py checks it on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepstep.elastic import reduce_device, reduce_graph, reduce_kernels
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.reduce import (
    ExactReducer,
    ReduceDone,
    ReduceNonFinite,
    ReduceOutcome,
    ReduceOverflow,
)

FAST = settings(max_examples=60, deadline=None)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(1,), (7,), (3, 5), (0,), (2, 3, 4)]
BITS = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
# Values planted into gradients: signed zeros, subnormals of each width, non-finite values.
SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 5e-324, -5e-324, 6e-8, math.nan, math.inf, -math.inf]
Grads = list[torch.Tensor | None]


def paths() -> list[dict[str, bool]]:
    out = [{"kernels": False, "fused": False}, {"kernels": False, "fused": True}]
    if reduce_kernels.available():
        out.append({"kernels": True})
    return [*out, {"device_ops": True}]


@dataclass(frozen=True)
class Case:
    """One job's parameters and every micro-batch gradient of two steps."""

    specs: list[tuple[tuple[int, ...], torch.dtype, bool]]  # shape, dtype, transposed
    n_micro: int
    steps: list[list[Grads]]

    def params(self) -> list[torch.Tensor]:
        return [
            torch.zeros(s[::-1], dtype=d).t() if t else torch.zeros(s, dtype=d)
            for s, d, t in self.specs
        ]


@st.composite
def cases(draw: st.DrawFn, specials: bool = True) -> Case:
    n_t = draw(st.integers(1, 4))
    specs = []
    for _ in range(n_t):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.sampled_from(SHAPES))
        specs.append((shape, dtype, len(shape) == 2 and draw(st.booleans())))
    n_micro = draw(st.sampled_from([1, 3, 4, 12]))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    k0 = 53 - (n_micro - 1).bit_length() - 16  # the first step's exponent
    steps = []
    for _ in range(2):
        batches: list[Grads] = []
        for _ in range(n_micro):
            grads: Grads = []
            for shape, dtype, transposed in specs:
                if draw(st.integers(0, 9)) == 0:
                    grads.append(None)
                    continue
                # Magnitudes from far below to far above the fixed-point range.
                exp = draw(st.integers(-160, 140))
                x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0**exp
                flat = x.view(-1)
                if flat.numel() and draw(st.booleans()):
                    flat[0] = (draw(st.integers(-9, 9)) + 0.5) * 2.0**-k0  # a rounding tie
                if flat.numel() and specials and draw(st.integers(0, 3)) == 0:
                    flat[-1] = draw(st.sampled_from(SPECIAL))
                if not specials:  # finite in the gradient's dtype (it may still overflow)
                    x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
                g = x.to(dtype)
                grads.append(g.t().contiguous().t() if transposed else g)
            batches.append(grads)
        steps.append(batches)
    return Case(specs, n_micro, steps)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, every nan counted equal to every nan (payloads are not data)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = BITS[a.dtype]
    return torch.equal(
        a.masked_fill(nan, 0).contiguous().view(ints), b.masked_fill(nan, 0).contiguous().view(ints)
    )


@dataclass
class Run:
    """What one path produced: per micro-batch buffers, outcomes, grads and exponents."""

    buffers: list[torch.Tensor]
    maxima: list[torch.Tensor]
    outcomes: list[ReduceOutcome]
    grads: list[list[torch.Tensor | None]]
    exponents: list[tuple[int, ...]]
    added: list[reduce_device.AddPath | None]  # how the device path added each micro-batch


def run(case: Case, path: dict[str, bool]) -> Run:
    params = case.params()
    reducer = ExactReducer(params, case.n_micro, **path)
    device = reducer._device
    out = Run([], [], [], [], [], [])
    for batches in case.steps:
        for attempt in range(2):
            reducer.begin_step()
            for grads in batches:
                reducer.add_micro_batch(grads)
                out.added.append(None if device is None else device.last_path)
                out.buffers.append(reducer.buffer().clone())
                out.maxima.append(reducer.retry_max_buffer())
            outcome = reducer.finish(reducer.buffer().clone(), case.n_micro, params)
            out.outcomes.append(outcome)
            out.grads.append([p.grad for p in params])
            out.exponents.append(reducer.exponents)
            if not isinstance(outcome, ReduceOverflow) or attempt:
                break
            reducer.set_retry_exponents(reducer.retry_max_buffer())
        if isinstance(out.outcomes[-1], ReduceNonFinite):
            break
    return out


def assert_same_run(a: Run, b: Run, n_data: int) -> None:
    assert a.outcomes == b.outcomes
    assert a.exponents == b.exponents
    assert len(a.buffers) == len(b.buffers)
    for i, (x, y) in enumerate(zip(a.buffers, b.buffers, strict=True)):
        # Every element: the tail (counts, quantized peaks, presence) bit for bit, the data
        # too, nan counted equal to nan (after an overflow the data is never read, and
        # inf - inf gives a nan whose payload is the hardware's).
        assert torch.equal(x[n_data:].view(torch.int64), y[n_data:].view(torch.int64)), i
        assert same_bits(x[:n_data], y[:n_data]), i
    for x, y in zip(a.maxima, b.maxima, strict=True):
        assert same_bits(x, y)
    for ga, gb in zip(a.grads, b.grads, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.stride() == y.stride()
                assert same_bits(x, y)


def check_all_paths(case: Case) -> list[ReduceOutcome]:
    n_data = sum(math.prod(s) for s, _, _ in case.specs)
    runs = [run(case, p) for p in paths()]
    for other in runs[1:]:
        assert_same_run(runs[0], other, n_data)
    return runs[0].outcomes


@FAST
@given(cases())
def test_device_path_gives_the_bits_of_every_cpu_path(case: Case) -> None:
    check_all_paths(case)


@FAST
@given(cases(specials=False))
def test_device_path_matches_on_finite_gradients_through_retries(case: Case) -> None:
    outcomes = check_all_paths(case)
    assert not any(isinstance(o, ReduceNonFinite) for o in outcomes)


def test_the_cases_reach_every_outcome() -> None:
    """The strategy is not vacuous: fixed draws give a clean step, an overflow retried to a
    clean step, and a non-finite step, each identical on every path."""
    tiny = Case([((4,), torch.float32, False)], 1, [[[torch.tensor([1.0, -0.0, 1e-40, 3.0])]]])
    assert check_all_paths(tiny) == [ReduceDone()]
    big = Case([((2,), torch.bfloat16, False)], 3, [[[torch.full((2,), 2.0**100).bfloat16()]] * 3])
    assert check_all_paths(big) == [ReduceOverflow(micro_batches=3), ReduceDone()]
    bad = Case([((2,), torch.float16, False)], 1, [[[torch.tensor([math.nan, 1.0]).half()]]])
    outcomes = check_all_paths(bad)
    assert len(outcomes) == 1 and isinstance(outcomes[0], ReduceNonFinite)


def test_a_negative_zero_never_reaches_a_gradient() -> None:
    """-0.0 and negative values that round to 0 sum to +0.0 on every path and grouping:
    the sign of zero is part of the bits."""
    for path in paths():
        params = [torch.zeros(3)]
        reducer = ExactReducer(params, 1, **path)
        reducer.begin_step()
        reducer.add_micro_batch([torch.tensor([-0.0, -1e-30, 1.0])])
        assert isinstance(reducer.finish(reducer.buffer(), 1, params), ReduceDone)
        grad = params[0].grad
        assert grad is not None
        assert grad.view(torch.int32).tolist() == [0, 0, torch.tensor(1.0).view(torch.int32).item()]


def test_quantize_add_is_the_formula() -> None:
    acc = torch.zeros(4, dtype=torch.float64)
    scale = torch.tensor(2.0**3, dtype=torch.float32)
    g = torch.tensor([[0.0625, -0.1875], [1.0, math.inf]])  # x 8: 0.5, -1.5 (ties), 8, inf
    peak = reduce_device.quantize_add(g.t(), scale, acc)
    assert acc.tolist() == [0.0, 8.0, -2.0, math.inf]  # row-major order of the transpose
    assert peak.dtype == torch.float64 and peak.item() == math.inf
    g[0, 0] = math.nan
    assert reduce_device.quantize_add(g, scale, acc).isnan()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_ops": 1}, r"device_ops=1 must be a bool or None"),
        ({"device_ops": True, "kernels": True}, r"kernels need device_ops off"),
        ({"compile": True}, r"compile needs it on"),
        ({"device_ops": True, "compile": "yes"}, r"compile='yes' must be a bool or None"),
    ],
)
def test_bad_path_choices_name_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ExactReducer([torch.zeros(2)], 2, **kwargs)  # type: ignore[arg-type]


def test_the_device_path_has_no_scratch_buffers() -> None:
    reducer = ExactReducer(
        [torch.zeros(3, 3), torch.zeros(4, dtype=torch.float64)], 2, device_ops=True
    )
    assert not hasattr(reducer, "_wide") and not hasattr(reducer, "_f32")


def test_each_path_says_which_it_is() -> None:
    params = [torch.zeros(3)]
    assert ExactReducer(params, 2, kernels=False).path == "tensor-ops"
    assert ExactReducer(params, 2, device_ops=True).path == "device-eager"  # no compile on CPU
    if reduce_kernels.available():
        assert ExactReducer(params, 2).path == "cpu-kernels"


def test_a_compiler_that_fails_is_named_when_compile_was_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: object, **kwargs: object) -> object:
        def run(*a: object) -> object:
            raise RuntimeError("no C++ compiler in this image")

        return run

    # One compiled wrapper per process: a fresh one.
    reduce_graph._compiled.cache_clear()
    monkeypatch.setattr(torch, "compile", broken)
    try:
        with pytest.raises(ConfigError, match=r"compile=True but torch.compile failed.*no C\+\+"):
            ExactReducer([torch.zeros(4)], 2, device_ops=True, compile=True)
        # Not asked for (the CPU's default): eager ops, the compiler never called.
        assert ExactReducer([torch.zeros(4)], 2, device_ops=True).path == "device-eager"
    finally:
        reduce_graph._compiled.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled Inductor path")
def test_compiled_cuda_path_gives_the_cpu_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    cpu = [torch.zeros(64, 33), torch.zeros(17, dtype=torch.bfloat16)]
    cuda = [p.cuda() for p in cpu]
    a = ExactReducer(cpu, 4, kernels=False)
    b = ExactReducer(cuda, 4, compile=True)
    for r in (a, b):
        r.begin_step()
    for _ in range(4):
        g = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in cpu]
        a.add_micro_batch(g)
        b.add_micro_batch([x.cuda() for x in g])
        assert b._device is not None and b._device.last_path == reduce_device.AddPath.GRAPH
    assert torch.equal(a.buffer().view(torch.int64), b.buffer().cpu().view(torch.int64))
