"""`keepstep.init`: the entry point of a training script.

This is the one place the library reads the environment. A launcher (`keepstep run`, the
node agent, `keepstep selfcheck`) passes the job's numbers and the controller through
`KEEPSTEP_*` variables; a script run on its own trains as a single member. An argument
given both in code and by the launcher must agree, so a script cannot silently train with
another global batch than the job was started with.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import HashStore

from keepstep import fatal
from keepstep.elastic.board import open_board
from keepstep.elastic.config import Balance, JobConfig, Shard
from keepstep.elastic.control import Controller, ScheduleController
from keepstep.elastic.errors import ConfigError
from keepstep.elastic.job import Job
from keepstep.elastic.optimizer_group import as_optimizer
from keepstep.elastic.reduce import ReduceMode
from keepstep.elastic.slow_drain import DrainSlow
from keepstep.elastic.snapshot_seed import read_seed
from keepstep.elastic.snapshot_store import FileBuffer, MemoryBuffer, SnapshotBuffer, SnapshotStore
from keepstep.elastic.tracked import Stateful

ENV_PREFIX = "KEEPSTEP_"


def _setting(name: str, given: Any, cast: Callable[[str], Any], env: Mapping[str, str]) -> Any:
    key = ENV_PREFIX + name.upper()
    raw = env.get(key)
    if raw is None:
        return given
    try:
        value = cast(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {name}") from None
    if given is not None and given != value:
        raise ConfigError(
            f"the script passes {name}={given!r} but the launcher set {key}={raw}; "
            "drop the argument or make them agree"
        )
    return value


def _default(value: Any, default: Any) -> Any:
    """`value` unless it is None: a 0 or "" given stays, for JobConfig to refuse."""
    return default if value is None else value


def _mode(value: str | None) -> ReduceMode:
    if value is None:
        return ReduceMode.EXACT
    try:
        return ReduceMode(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in ReduceMode)
        raise ConfigError(f"mode={value!r}: must be one of {allowed}") from None


def controller_from_env(env: Mapping[str, str]) -> Controller:
    """The controller named by KEEPSTEP_CONTROLLER ("module:function"), else a single member."""
    spec = env.get(ENV_PREFIX + "CONTROLLER")
    if not spec:
        return ScheduleController(store_=HashStore(), me="0", schedule=[["0"]])
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"KEEPSTEP_CONTROLLER={spec!r} must look like 'package.module:function'")
    factory = getattr(importlib.import_module(module_name), attr)
    controller: Controller = factory(env)
    return controller


def _names(metrics: Sequence[str]) -> tuple[str, ...]:
    if isinstance(metrics, str):  # a tuple of its letters is never what was meant
        raise ConfigError(f"metrics={metrics!r} must be a sequence of names, e.g. ({metrics!r},)")
    return tuple(metrics)


def _drain_slow(given: DrainSlow | str | None) -> DrainSlow | None:
    return DrainSlow.parse(given) if isinstance(given, str) else given


def _snapshot_buffer(path: str | None) -> SnapshotBuffer:
    if not path:
        return MemoryBuffer(0)
    # A restarted worker reopens its node's snapshot file; a new one creates it.
    return FileBuffer.open_or_create(path)


def init(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    dataset: Any,
    global_batch: int | None = None,
    micro_batch: int | None = None,
    seed: int | None = None,
    *,
    mode: ReduceMode | str | None = None,
    threads: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    state: Mapping[str, Stateful] | None = None,
    clip_grad_norm: float | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    metrics: Sequence[str] = (),
    prefetch: int = 0,
    loader_workers: int = 0,
    balance: Balance | str | None = None,
    shard: Shard | str | None = None,
    drain_slow: DrainSlow | str | None = None,
    tensorboard: str | None = None,
    collective_timeout: float | None = None,
    weighted_mean: bool = False,
    controller: Controller | None = None,
    snapshot_path: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Job:
    """Make a plain PyTorch loop elastic. See README for the ten-line loop.

    ``optimizer``: one, or a list stepped as one in its order (``[Muon(matrices),
    AdamW(the rest)]``: optimizer_group.py), each parameter in one of them.

    ``state``: objects with ``state_dict()`` / ``load_state_dict()`` (LR schedulers, an
    EMA model...) kept in every snapshot with the parameters, by name (`Job.track` adds
    more). ``clip_grad_norm``: clip the reduced gradient to this global norm before each
    optimizer step. ``grad_scaler``: an enabled ``torch.amp.GradScaler`` the job drives
    (loss scaling for float16): the script calls ``step.backward(scaler.scale(loss))`` and
    nothing else of it; the job unscales the reduced gradient before hooks and clipping,
    skips a step whose reduced gradient has inf or nan (``CommitResult.skipped``) and
    updates the scale as ``scaler.step(opt); scaler.update()`` would. It is tracked as
    ``"grad_scaler"``. ``metrics``: the names ``step.log`` takes (e.g. ``("loss",)``),
    reduced across members to the same value at any world size. ``prefetch``: micro-batches
    read ahead on a background thread (the dataset's ``__getitem__`` must be thread-safe).
    ``loader_workers=N``: read them in N forked processes instead, for reads that hold the
    GIL (decoding, augmentation); each read is keyed like the training thread's, so the
    batches are the same bits (``prefetch`` defaults to 2N then).
    ``balance="speed"``: a slow member gets fewer micro-batches, from measured speed
    (balance.py); the numbers stay those of an even split. Default ``"off"``.
    ``shard="zero1"``: each member steps and keeps the optimizer state of its own shard and
    the parameters are all-gathered (ZeRO-1, sharded.py), bit-identical to the full step;
    the optimizer must be elementwise (SGD, Adam, AdamW, ...) or Muon (zero/muon.py), or
    a list of these. ``shard="zero2"`` (exact
    mode): each member also holds only its shard of the reduced gradient (a
    reduce-scatter), with the same numbers. Default None: full replicas.
    ``drain_slow="0.25:20"`` (or ``DrainSlow(below=0.25, after=20)``): a member slower than
    0.25x the median speed for 20 committed steps in a row has its node drained at a step
    boundary, as a planned change (slow_drain.py; the node agent refuses a drain below the
    job's minimum nodes). Default None: never.
    ``tensorboard``: a folder where the leader writes the ``metrics`` as TensorBoard scalars
    (needs the tensorboard package; ``keepstep run --tensorboard DIR`` sets it).
    ``collective_timeout``: seconds a member waits in one collective before it takes a peer
    for lost (default 30; ``KEEPSTEP_COLLECTIVE_TIMEOUT``, ``keepstep run
    --collective-timeout``): raise it for steps whose members can arrive that far apart
    (a first step that compiles, a slow read) or whose all-reduce takes that long.
    ``weighted_mean=True``: each micro-batch passes its loss summed over some unit (tokens
    that count) and how many it summed, ``step.backward(loss_sum, weight=n)``; the reduced
    gradient is the global batch's mean per unit: the summed gradients over the summed
    weights, whatever the members and however the units fall across micro-batches.
    """
    env = os.environ if env is None else env
    fatal.install_hook(env)  # under an agent: a ConfigError that ends the script ends the job
    stepper = as_optimizer(optimizer)  # a list: stepped as one (optimizer_group.py)
    global_batch = _setting("global_batch", global_batch, int, env)
    micro_batch = _setting("micro_batch", micro_batch, int, env)
    if global_batch is None or micro_batch is None:
        raise ConfigError(
            f"global_batch={global_batch} and micro_batch={micro_batch}: both are required "
            "(as arguments or from the launcher)"
        )
    config = JobConfig(
        global_batch=global_batch,
        micro_batch=micro_batch,
        seed=_setting("seed", seed, int, env) or 0,
        mode=_mode(_setting("mode", mode, str, env)),
        threads=_default(_setting("threads", threads, int, env), 1),
        # The address peers reach this process on (a pod's IP, a node's namespace address):
        # gloo binds its device to it and publishes it to the other members.
        host=env.get(ENV_PREFIX + "HOST") or "127.0.0.1",
        planned_steps=_setting("steps", None, int, env),
        checkpoint_every=_setting("checkpoint_every", None, int, env),
        clip_grad_norm=clip_grad_norm,
        metrics=_names(metrics),
        prefetch=prefetch,
        loader_workers=loader_workers,
        balance=_setting("balance", balance, str, env) or Balance.OFF,  # JobConfig checks it
        shard=_setting("shard", shard, str, env) or None,  # JobConfig checks it
        drain_slow=_setting("drain_slow", _drain_slow(drain_slow), DrainSlow.parse, env),
        collective_timeout=_default(
            _setting("collective_timeout", collective_timeout, float, env), 30.0
        ),
        weighted_mean=weighted_mean,
    )
    if controller is None:
        controller = controller_from_env(env)
    path = snapshot_path or env.get(ENV_PREFIX + "SNAPSHOT")
    store = SnapshotStore(_snapshot_buffer(path))
    resume = env.get(ENV_PREFIX + "RESUME")
    if resume and not store.infos():  # started from a durable checkpoint, none since
        store.seed(read_seed(Path(resume), "the checkpoint to resume from"))
    board_dir = _setting("tensorboard", tensorboard, str, env)
    board = open_board(board_dir) if board_dir is not None else None  # refused before training
    job = Job(model, stepper, dataset, config, controller, store, collate_fn, grad_scaler)
    job.board = board
    if state is not None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"state={state!r}: must map names to objects with state_dict()")
        for name, obj in state.items():
            job.track(name, obj)
    return job
