"""Tests of keepstep.elastic.train_state: capture, restore through a snapshot store, layouts."""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable, Iterator

import pytest
import torch

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, StateShapeError
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotBuffer, SnapshotStore
from keepstep.elastic.train_state import (
    TrainState,
    capture,
    check_layout,
    layout_signature,
    params_sha256,
    restore,
)

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99)),
    "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), foreach=False),
}


def _model(seed: int, hidden: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 2),
    )


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return dict(capture(0, model, opt).tensors)


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def _optim(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[kind](list(model.parameters()))


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # tiny models: intra-op threads only add contention on a shared machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_round_trip_through_a_store_is_bit_identical(kind: str, buffer: SnapshotBuffer) -> None:
    model = _model(0)
    opt = _optim(kind, model)
    _train(model, opt, 3, seed=1)
    reducer_state = {"scale": torch.tensor([2.0**-20]), "overflows": torch.tensor(3)}
    with SnapshotStore(buffer) as store:
        state = capture(3, model, opt, reducer_state)
        store.commit(state.step, state.tensors, state.meta)
        store.wait()
        snap = store.load()

    other = _model(42)  # different initial values, same architecture
    other_opt = _optim(kind, other)
    params_before = [(id(p), p.data_ptr()) for p in other.parameters()]
    extra = restore(snap, other, other_opt)

    assert snap.step == 3
    _assert_bit_identical(extra, reducer_state)
    _assert_bit_identical(_flat_state(other, other_opt), _flat_state(model, opt))
    assert other_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert [(id(p), p.data_ptr()) for p in other.parameters()] == params_before
    # and training goes on identically from there
    _train(model, opt, 2, seed=9)
    _train(other, other_opt, 2, seed=9)
    _assert_bit_identical(_flat_state(other, other_opt), _flat_state(model, opt))
    buffer.close()


@pytest.mark.parametrize("kind", ["sgd-momentum", "adam"])
def test_restore_rolls_back_in_place(kind: str) -> None:
    model = _model(0)
    opt = _optim(kind, model)
    _train(model, opt, 2, seed=1)
    store = SnapshotStore(MemoryBuffer(), background=False)
    for step in (2, 3):
        state = capture(step, model, opt)
        store.commit(step, state.tensors, state.meta)
        if step == 2:
            at_2 = {k: v.clone() for k, v in _flat_state(model, opt).items()}
            _train(model, opt, 1, seed=5)
    at_3 = {k: v.clone() for k, v in _flat_state(model, opt).items()}
    live = _flat_state(model, opt)

    restore(store.load(2), model, opt)
    _assert_bit_identical(_flat_state(model, opt), at_2)
    # the very same tensor objects: parameters and optimizer slots were overwritten in place
    for name, now in _flat_state(model, opt).items():
        if name.startswith("optim/"):
            assert now is live[name], name
        else:  # state_dict() makes new tensor objects over the same storage
            assert now.data_ptr() == live[name].data_ptr(), name
    restore(store.load(3), model, opt)
    _assert_bit_identical(_flat_state(model, opt), at_3)


def test_snapshot_grows_when_adam_state_appears() -> None:
    model = _model(0, hidden=64)
    opt = torch.optim.Adam(model.parameters())
    buffer = MemoryBuffer()
    store = SnapshotStore(buffer)
    state0 = capture(0, model, opt)  # no optimizer state before the first step
    store.commit(0, state0.tensors, state0.meta)
    store.wait()
    size0 = buffer.size
    _train(model, opt, 1, seed=1)
    state1 = capture(1, model, opt)
    store.commit(1, state1.tensors, state1.meta)
    store.wait()
    assert buffer.size > size0
    assert len(state1.tensors) == len(state0.tensors) + 3 * len(list(model.parameters()))

    fresh = _model(7, hidden=64)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    restore(store.load(1), fresh, fresh_opt)
    _assert_bit_identical(_flat_state(fresh, fresh_opt), _flat_state(model, opt))
    restore(store.load(0), fresh, fresh_opt)  # back to before the first step: no Adam state
    assert fresh_opt.state_dict()["state"] == {}
    store.close()


def test_capture_returns_live_tensors() -> None:
    model = _model(0)
    opt = _optim("adam", model)
    _train(model, opt, 1, seed=1)
    state = capture(1, model, opt)
    first = next(iter(model.parameters()))
    assert state.tensors["model/0.weight"].data_ptr() == first.data_ptr()
    assert state.tensors["optim/0/exp_avg"] is opt.state[first]["exp_avg"]
    assert "optim/0/step" in state.tensors and "model/1.running_mean" in state.tensors


@pytest.mark.parametrize(
    ("other", "names"),
    [
        (lambda: _model(0, hidden=5), ["model/0.weight", "(6, 4)", "(5, 4)"]),
        (lambda: _model(0).double(), ["model/0.weight", "float64", "float32"]),
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 6)), ["model state", "1.running_mean"]),
    ],
)
def test_a_changed_model_is_refused_by_name(
    other: Callable[[], torch.nn.Module], names: list[str]
) -> None:
    model = _model(0)
    opt = _optim("adam", model)
    _train(model, opt, 1, seed=1)
    state = capture(1, model, opt)
    target = other()
    target_opt = torch.optim.Adam(target.parameters())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateShapeError) as caught:
        restore(state, target, target_opt)
    for name in names:
        assert name in str(caught.value)
    _assert_bit_identical(target.state_dict(), before)  # nothing was written
    assert target_opt.state_dict()["state"] == {}


def test_optimizer_state_of_another_shape_is_refused_by_name() -> None:
    model = _model(0)
    opt = _optim("adam", model)
    _train(model, opt, 1, seed=1)
    state = capture(1, model, opt)
    first = next(iter(model.parameters()))
    opt.state[first]["exp_avg"] = torch.zeros(3)
    with pytest.raises(StateShapeError, match=r"optim/0/exp_avg: expected \(3,\)"):
        restore(state, model, opt)
    other = _model(0)
    with pytest.raises(StateShapeError, match="param groups"):
        restore(state, other, torch.optim.Adam(list(other.parameters())[:2]))


def test_layout_signature_and_check_layout() -> None:
    model = _model(0)
    layout = layout_signature(model)
    assert layout[0] == ("0.weight", (6, 4), "float32")
    assert ("1.num_batches_tracked", (), "int64") in layout
    check_layout(layout, model)
    first = model.get_submodule("0")
    assert isinstance(first, torch.nn.Linear)
    first.weight = torch.nn.Parameter(torch.zeros(6, 5))
    model.register_buffer("new_thing", torch.zeros(1))
    with pytest.raises(StateShapeError) as caught:
        check_layout(layout, model)
    assert "0.weight: expected (6, 4) float32, found (6, 5) float32" in str(caught.value)
    assert "new_thing: new" in str(caught.value)


def test_non_plain_values_are_refused() -> None:
    model = _model(0)
    opt = _optim("sgd-momentum", model)
    _train(model, opt, 1, seed=1)
    first = next(iter(model.parameters()))
    opt.state[first]["weird"] = object()
    with pytest.raises(ConfigError, match=r"state\[0\]\['weird'\]"):
        capture(1, model, opt)
    with pytest.raises(ConfigError, match="extra"):
        capture(1, model, _optim("adam", model), {"x": 1.0})  # type: ignore[dict-item]
    # A pickle is never read, not even a harmless one: a snapshot may come from anywhere.
    evil = pickle.dumps(collections.OrderedDict())
    with pytest.raises(SnapshotCorrupt, match="is a pickle"):
        restore(TrainState(0, {}, evil), model, opt)
    for garbage in (b"{", b'{"x": 1}', b'{"d": [[{"s": [[1]]}, 1]]}', b'{"b": "%%"}'):
        with pytest.raises(SnapshotCorrupt, match="unreadable snapshot meta"):
            restore(TrainState(0, {}, garbage), model, opt)
    with pytest.raises(ConfigError):
        TrainState(-1, {}, b"")


def test_params_sha256_covers_0_dim_state_and_tracked_state() -> None:
    # BatchNorm's num_batches_tracked is a 0-dim tensor: it has no byte view of its own.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    state = model.state_dict()
    digest = params_sha256(state, None)
    state["1.num_batches_tracked"] += 1
    assert params_sha256(state, None) != digest
    assert params_sha256(state, "ab" * 32) != params_sha256(state, None)
