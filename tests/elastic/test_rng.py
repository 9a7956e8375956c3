"""Tests of keepstep.elastic.rng: data and randomness keyed by (seed, step, micro-batch)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.rng import (
    CUBLAS_WORKSPACE_CONFIG,
    SampleOrder,
    current_device_generators,
    derive_seed,
    fix_determinism,
    rng_scope,
)


def test_derive_seed_is_stable_and_separates_keys() -> None:
    base = derive_seed(7, 3, 2, "x")
    assert base == derive_seed(7, 3, 2, "x")
    assert 0 <= base < 2**63
    others = [
        derive_seed(8, 3, 2, "x"),
        derive_seed(7, 4, 2, "x"),
        derive_seed(7, 3, 1, "x"),
        derive_seed(7, 3, 2, "y"),
        derive_seed(7, 3, 2),
        # Fields must not run into each other: (1, 23) and (12, 3) are different keys.
        derive_seed(7, 1, 23, "x"),
        derive_seed(7, 12, 3, "x"),
    ]
    assert len({base, *others}) == len(others) + 1


def test_derive_seed_same_in_another_process() -> None:
    keys = [(0, 0, 0, ""), (7, 3, 2, "x"), (2**40, 10**6, 63, "data-epoch")]
    code = (
        "from keepstep.elastic.rng import derive_seed\n"
        f"for k in {keys!r}:\n"
        "    print(derive_seed(*k))\n"
    )
    # A different hash seed would change hash(); derive_seed must not care.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert [int(line) for line in out.stdout.split()] == [derive_seed(*k) for k in keys]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 0, 0), r"seed=-1 must be an int >= 0"),
        ((0, -1, 0), r"step=-1 must be an int >= 0"),
        ((0, 0, 1.5), r"micro_batch_id=1\.5 must be an int >= 0"),
        ((0, 0, 0, 3), r"stream=3 must be a str"),
    ],
)
def test_derive_seed_rejects_bad_keys(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        derive_seed(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("shuffle", [True, False])
def test_one_data_epoch_reads_every_sample_once(shuffle: bool) -> None:
    # 4 micro-batches of 5 = 20 samples per step; 5 steps are exactly one pass over 100.
    order = SampleOrder(seed=11, dataset_len=100, micro_batch=5, n_micro=4, shuffle=shuffle)
    seen = [i for step in range(5) for mb in range(4) for i in order.indices(step, mb)]
    assert sorted(seen) == list(range(100))
    assert (seen == list(range(100))) is not shuffle
    # The next pass is a different permutation of the same samples.
    again = [i for step in range(5, 10) for mb in range(4) for i in order.indices(step, mb)]
    assert sorted(again) == list(range(100))
    assert (again != seen) is shuffle


def test_micro_batch_straddling_a_data_epoch() -> None:
    # 3 micro-batches of 4 = 12 per step over 10 samples: positions 8..11 of step 0's
    # micro-batch 2 are the last two samples of epoch 0 and the first two of epoch 1.
    order = SampleOrder(seed=3, dataset_len=10, micro_batch=4, n_micro=3)
    flat = [i for step in range(5) for mb in range(3) for i in order.indices(step, mb)]
    assert len(flat) == 60
    for epoch in range(6):
        assert sorted(flat[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    straddler = order.indices(0, 2)
    assert straddler == flat[8:12]
    assert len(set(straddler[:2]) | set(flat[:8])) == 10
    # Per-data-epoch counts: every sample exactly once in each of the six passes.
    assert Counter(flat) == {i: 6 for i in range(10)}


def test_indices_depend_only_on_seed_step_and_micro_batch() -> None:
    def make() -> SampleOrder:
        return SampleOrder(seed=5, dataset_len=37, micro_batch=3, n_micro=4)

    warm = make()
    # Warm one instance's cache on far-away epochs, read another one backwards.
    for step in (50, 7, 0, 99):
        warm.indices(step, 3)
    cold = make()
    keys = [(s, m) for s in range(12) for m in range(4)]
    expected = {k: cold.indices(*k) for k in reversed(keys)}
    assert {k: warm.indices(*k) for k in keys} == expected
    # Global RNG state does not leak in.
    torch.manual_seed(0)
    random.seed(0)
    assert make().indices(4, 1) == expected[(4, 1)]
    assert (
        SampleOrder(seed=6, dataset_len=37, micro_batch=3, n_micro=4).indices(4, 1)
        != (expected[(4, 1)])
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": -3}, r"seed=-3 must be an int >= 0"),
        ({"dataset_len": 0}, r"dataset_len=0 must be an int >= 1"),
        ({"micro_batch": 0}, r"micro_batch=0 must be an int >= 1"),
        ({"n_micro": 2.0}, r"n_micro=2\.0 must be an int >= 1"),
        ({"micro_batch": 11}, r"micro_batch=11 is larger than dataset_len=10"),
        ({"shuffle": 1}, r"shuffle=1 must be a bool"),
    ],
)
def test_sample_order_rejects_bad_config(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"seed": 0, "dataset_len": 10, "micro_batch": 2, "n_micro": 3}
    with pytest.raises(ConfigError, match=match):
        SampleOrder(**{**args, **kwargs})  # type: ignore[arg-type]


def test_indices_rejects_out_of_range_micro_batch() -> None:
    order = SampleOrder(seed=0, dataset_len=10, micro_batch=2, n_micro=3)
    with pytest.raises(ConfigError, match=r"micro_batch_id=3 is out of range; ids are 0\.\.2"):
        order.indices(0, 3)
    with pytest.raises(ConfigError, match=r"step=-1 must be an int >= 0"):
        order.indices(-1, 0)


def _dropout_mask() -> torch.Tensor:
    return torch.nn.functional.dropout(torch.ones(256), p=0.5, training=True)


def test_rng_scope_keys_dropout_by_micro_batch() -> None:
    torch.manual_seed(1)
    with rng_scope(42, 3, 1):
        first = _dropout_mask()
        py_first = random.random()
        np_first = np.random.random()
    torch.manual_seed(2)  # A different outer state must not matter inside the scope.
    with rng_scope(42, 3, 1):
        second = _dropout_mask()
        py_second = random.random()
        np_second = np.random.random()
    with rng_scope(42, 3, 2):
        other_mb = _dropout_mask()
    with rng_scope(42, 4, 1):
        other_step = _dropout_mask()

    assert torch.equal(first, second)
    assert (py_first, np_first) == (py_second, np_second)
    assert not torch.equal(first, other_mb)
    assert not torch.equal(first, other_step)
    assert 0 < int((first == 0).sum()) < 256


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(8), random.random(), float(np.random.random())


def _reseed() -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)


@pytest.fixture
def seeded_globals() -> Iterator[None]:
    _reseed()
    yield


def test_rng_scope_restores_outer_state(seeded_globals: None) -> None:
    torch.rand(3)  # Move the outer state off its seed first.
    with rng_scope(1, 2, 3):
        _draws()
    after = _draws()

    _reseed()
    torch.rand(3)
    without = _draws()
    assert torch.equal(after[0], without[0])
    assert after[1:] == without[1:]


def test_rng_scope_restores_on_error(seeded_globals: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), rng_scope(1, 2, 3):
        _draws()
        raise RuntimeError("boom")
    after = _draws()
    _reseed()
    without = _draws()
    assert torch.equal(after[0], without[0])
    assert after[1:] == without[1:]


def test_rng_scope_keys_the_device_generator_by_micro_batch() -> None:
    """A CPU generator stands in for the CUDA one: seeded from its own stream of the same
    key (not the CPU generator's), the same whatever its state before, put back after."""
    device = torch.Generator().manual_seed(5)
    torch.rand(3, generator=device)
    before = device.get_state()
    with rng_scope(42, 3, 1, device_generators=[device]):
        first = torch.rand(8, generator=device)
        cpu = torch.rand(8)
    assert torch.equal(device.get_state(), before)
    device.manual_seed(99)  # another history must not matter inside the scope
    with rng_scope(42, 3, 1, device_generators=[device]):
        again = torch.rand(8, generator=device)
    with rng_scope(42, 3, 2, device_generators=[device]):
        other_mb = torch.rand(8, generator=device)
    expect = torch.Generator().manual_seed(derive_seed(42, 3, 1, "torch-cuda"))
    assert torch.equal(first, torch.rand(8, generator=expect))
    assert torch.equal(first, again)
    assert not torch.equal(first, other_mb)
    assert not torch.equal(first, cpu)  # independent of the CPU generator's stream


def test_rng_scope_restores_the_device_generator_on_error() -> None:
    device = torch.Generator().manual_seed(5)
    before = device.get_state()
    with pytest.raises(RuntimeError, match="boom"), rng_scope(1, 2, 3, [device]):
        torch.rand(4, generator=device)
        raise RuntimeError("boom")
    assert torch.equal(device.get_state(), before)


def test_rng_scope_never_initialises_cuda() -> None:
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        pytest.skip("CUDA was initialised by an earlier test in this process")
    assert current_device_generators() == []
    with rng_scope(1, 2, 3):
        torch.rand(2)
    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the device generator")
def test_cuda_dropout_is_keyed_and_the_generator_restored() -> None:
    x = torch.ones(4096, device="cuda")
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.manual_seed(1)
    before = gen.get_state()
    with rng_scope(42, 3, 1):
        first = torch.nn.functional.dropout(x, p=0.5)
    assert torch.equal(gen.get_state(), before)
    gen.manual_seed(2)
    with rng_scope(42, 3, 1):
        second = torch.nn.functional.dropout(x, p=0.5)
    with rng_scope(42, 3, 2):
        other = torch.nn.functional.dropout(x, p=0.5)
    assert torch.equal(first, second) and not torch.equal(first, other)


@pytest.fixture
def restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn


def test_fix_determinism_sets_the_gpu_flags(
    restore_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As at a worker's start: CUDA not started yet (on a GPU machine an earlier test may
    # have started it, and then fix_determinism rightly refuses an unset variable).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    torch.backends.cudnn.benchmark = True
    environ: dict[str, str] = {}
    fix_determinism(1, environ)
    assert environ == {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE_CONFIG}
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        cudnn = torch.backends.cudnn
        flags = [torch.backends.cuda.matmul, cudnn, cudnn.conv, cudnn.rnn]
        assert [f.fp32_precision for f in flags] == ["ieee"] * 4
    else:
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    kept = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    fix_determinism(1, kept)  # a deterministic value the user chose is kept
    assert kept == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


def test_fix_determinism_refuses_a_nondeterministic_cublas_config(
    restore_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0' is not deterministic"):
        fix_determinism(1, {"CUBLAS_WORKSPACE_CONFIG": ":0:0"})
    # Too late to set it: cuBLAS may have read the environment already.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    environ: dict[str, str] = {}
    with pytest.raises(ConfigError, match=r"CUDA is already initialised.*:4096:8"):
        fix_determinism(1, environ)
    assert environ == {}
    fix_determinism(1, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})  # set before: fine


def test_fix_determinism(restore_torch_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with pytest.raises(ConfigError, match=r"threads=0 must be an int >= 1"):
        fix_determinism(0)
    torch.use_deterministic_algorithms(False)
    # Parallel work has started in this process, so the inter-op call must be tolerated.
    _ = torch.ones(2) + 1
    fix_determinism(1)
    assert torch.get_num_threads() == 1
    assert torch.are_deterministic_algorithms_enabled()
