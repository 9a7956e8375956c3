"""The scenario both the unsharded reference and ZeRO's shards train (test_zero.py, and
its gloo worker): parameters of uneven sizes, optimizers of every supported kind in two
param groups, the gradients of each step, hashes of parameters and state, and ranks on
threads of this process (the ``LocalGathers`` fake)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from keepstep.elastic.shard import Range
from keepstep.elastic.zero import LocalGathers, Ownership, ZeroOptimizer

# Uneven on purpose: no size divides by 2, 3 or 4 everywhere; a scalar and an empty tensor.
SHAPES: list[tuple[int, ...]] = [(37, 5), (300,), (1,), (0,), (700, 3), ()]
STEPS = 3
TIMEOUT = timedelta(seconds=20)
CPU = torch.device("cpu")
OPT = torch.optim
Config = tuple[type[torch.optim.Optimizer], dict[str, Any]]

CONFIGS: dict[str, Config] = {
    "sgd-momentum-wd": (OPT.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd-nesterov-foreach": (
        OPT.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01, "foreach": True},
    ),
    # Without momentum: torch's fused SGD fails on a momentum buffer that starts after the
    # first step (tensor 2 has no gradient at step 0), sharded or not.
    "sgd-fused": (OPT.SGD, {"lr": 0.1, "weight_decay": 0.01, "fused": True}),
    "adam-wd": (OPT.Adam, {"lr": 1e-3, "weight_decay": 0.01}),
    "adam-amsgrad-foreach": (OPT.Adam, {"lr": 1e-3, "amsgrad": True, "foreach": True}),
    "adam-fused": (OPT.Adam, {"lr": 1e-3, "fused": True}),
    "adamw": (OPT.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "adamw-fused-maximize": (OPT.AdamW, {"lr": 1e-3, "fused": True, "maximize": True}),
    "adamax": (OPT.Adamax, {"lr": 1e-3, "weight_decay": 0.1}),
    "nadam": (OPT.NAdam, {"lr": 1e-3, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    "radam": (OPT.RAdam, {"lr": 1e-3, "weight_decay": 0.1}),
    "rmsprop": (OPT.RMSprop, {"lr": 1e-3, "momentum": 0.9, "centered": True}),
    "adagrad": (OPT.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    "adadelta": (OPT.Adadelta, {"lr": 1.0, "weight_decay": 0.1}),
    "asgd": (OPT.ASGD, {"lr": 0.01, "t0": 1}),
    "rprop": (OPT.Rprop, {"lr": 0.01}),
}


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def make_optimizer(config: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Two param groups with different lr (and weight decay, where the class has one)."""
    cls, kw = config
    second: dict[str, Any] = {"params": params[3:], "lr": kw.get("lr", 1e-3) / 3}
    if "weight_decay" in kw:
        second["weight_decay"] = 0.2
    return cls([{"params": params[:3]}, second], **kw)


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The reduced gradient of ``step``; tensor 2 has none at step 0 (its step count lags)."""
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = None if (i == 2 and step == 0) else grad


def params_sha(params: list[torch.nn.Parameter]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_sha(state_dict: Mapping[str, Any]) -> str:
    """sha256 over an optimizer state dict: every value's key, dtype, shape and bytes."""
    h = hashlib.sha256()
    for i, state in sorted(state_dict["state"].items()):
        for key, v in sorted(state.items()):
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            h.update(f"{i}/{key}/{t.dtype}/{tuple(t.shape)}/{t.device};".encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference(config: Config, steps: int = STEPS, dtype: torch.dtype = torch.float32) -> Any:
    params = make_params(dtype)
    opt = make_optimizer(config, params)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return params, opt


def owning(sizes: tuple[int, ...], ranges: list[list[tuple[int, int]]]) -> Ownership:
    return Ownership(sizes, tuple(tuple(Range(*r) for r in mine) for mine in ranges))


def clone_value(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def sizes() -> list[int]:
    return [int(torch.Size(s).numel()) for s in SHAPES]


def chunked(world: int, chunk: int = 97) -> Ownership:
    """Rank r owns chunks r, r + W, r + 2W, ...: several ranges per rank."""
    total = sum(sizes())
    ranges: list[list[Range]] = [[] for _ in range(world)]
    for i, start in enumerate(range(0, total, chunk)):
        ranges[i % world].append(Range(start, min(start + chunk, total)))
    return Ownership(tuple(sizes()), tuple(tuple(r) for r in ranges))


def on_threads(
    world: int, member: Callable[[int, Any], Any], device: torch.device | str = "cpu"
) -> list[Any]:
    """``member(rank, gather)`` for every rank, each on its own thread, gathering on
    ``device``; re-raises the first error (the others are released from the gather at
    once)."""
    return LocalGathers(world, device).run(member, timedelta(seconds=60))


def train_sharded(
    config: Config,
    ownership: Ownership,
    dtype: torch.dtype = torch.float32,
    steps: int = STEPS,
) -> list[tuple[str, str, int]]:
    """(params sha, gathered state sha, state bytes) of every rank after ``steps``."""

    def member(rank: int, gather: Any) -> tuple[str, str, int]:
        params = make_params(dtype)
        zero = ZeroOptimizer(
            params, make_optimizer(config, params), ownership, gather, timeout=TIMEOUT
        )
        for step in range(steps):
            set_grads(params, step)
            zero.step()
        return params_sha(params), state_sha(zero.full_state_dict()), zero.state_bytes()

    return on_threads(ownership.world, member)
