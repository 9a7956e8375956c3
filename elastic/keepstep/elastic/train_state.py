"""What a snapshot holds for one training process, and putting it back.

Where it sits: after each optimizer step the Job calls ``capture`` and hands the tensors to
``SnapshotStore.commit`` (snapshot_store.py); after a failure or on joining, it calls
``restore(store.load(step), model, optimizer, tracked=...)``. ``layout_signature`` /
``check_layout`` catch a model whose state changed shape between steps.

Tensor names::

    model/<state_dict key>             parameters and buffers
    optim/<param index>/<state key>    per-parameter optimizer state (exp_avg, step, ...)
    optim/groups/<group>/<key>         a param-group hyperparameter held as a tensor (lr)
    extra/<key>                        whatever the caller adds (e.g. the reducer's state)
    tracked/<name>/<i>                 tensors of the script's tracked objects (tracked.py)

``meta`` holds plain Python values only (param groups, non-tensor optimizer state, the
names in order, the plain part of tracked objects' state) as tagged JSON (plain_json.py),
never pickle: a snapshot may arrive from a peer over the network or from any checkpoint
URL, and reading it builds data only. A snapshot without tracked objects has no
``tracked`` entry in its meta.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from keepstep.elastic import plain_json
from keepstep.elastic.errors import ConfigError, SnapshotCorrupt, StateShapeError
from keepstep.elastic.snapshot_store import Snapshot
from keepstep.elastic.tracked import TrackedState, tensor_names

_FORMAT = 2  # 1: the meta was a pickle (refused now: a snapshot may come from anywhere)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
Layout = list[tuple[str, tuple[int, ...], str]]


@dataclass(frozen=True)
class TrainState:
    step: int
    tensors: dict[str, torch.Tensor]
    meta: bytes

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"step={self.step!r}: must be an int >= 0")
        for name, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"tensors[{name!r}]: must be a tensor, got {type(t).__name__}")
        if not isinstance(self.meta, bytes):
            raise ConfigError(f"meta: must be bytes, got {type(self.meta).__name__}")


def state_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` names the parameters: for a ``torch.compile``d model
    the module it wraps, whose keys lack the wrapper's ``_orig_mod.`` prefix. So snapshots,
    checkpoints, exports and hashes name the same tensors with or without compile, and a
    job resumes from a checkpoint written with the other setting."""
    # A compiled model means dynamo is imported already; never import it here (slow).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        inner = model._orig_mod
        if isinstance(inner, torch.nn.Module):
            return state_module(inner)
    return model


def capture(
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, torch.Tensor] | None = None,
    tracked: TrackedState | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
) -> TrainState:
    """The live state tensors (no copies: the store copies them) and the plain rest.

    ``optimizer_state``: the optimizer's full state dict when the optimizer itself does not
    hold it (a sharded job gathers it: sharded.py); by default ``optimizer.state_dict()``.
    """
    tensors: dict[str, torch.Tensor] = {}
    model_keys = []
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"model state {key!r} is a {type(value).__name__}, not a tensor")
        tensors[f"model/{key}"] = value
        model_keys.append(key)
    packed = optimizer.state_dict() if optimizer_state is None else optimizer_state
    groups: list[dict[str, Any]] = []
    group_tensors: list[list[str]] = []
    for gi, group in enumerate(packed["param_groups"]):
        groups.append({})
        group_tensors.append([])
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/groups/{gi}/{key}"] = value
                group_tensors[-1].append(key)
            else:
                groups[-1][key] = _plain(value, f"optimizer param_groups[{gi}][{key!r}]")
    state_plain: dict[int, dict[str, Any]] = {}
    state_tensors: dict[int, list[str]] = {}
    for idx, per_param in packed["state"].items():
        state_plain[idx], state_tensors[idx] = {}, []
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{idx}/{key}"] = value
                state_tensors[idx].append(key)
            else:
                state_plain[idx][key] = _plain(value, f"optimizer state[{idx}][{key!r}]")
    extra_keys = []
    for key, value in (extra or {}).items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"extra[{key!r}]: must be a tensor, got {type(value).__name__}")
        tensors[f"extra/{key}"] = value
        extra_keys.append(key)
    meta = {
        "format": _FORMAT,
        "model": model_keys,
        "groups": groups,
        "group_tensors": group_tensors,
        "state": state_plain,
        "state_tensors": state_tensors,
        "extra": extra_keys,
    }
    if tracked is not None and tracked.names:
        tracked_tensors, meta["tracked"] = tracked.capture()
        tensors.update(tracked_tensors)
    return TrainState(step, tensors, plain_json.dumps(meta))


def restore(
    state: TrainState | Snapshot,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tracked: TrackedState | None = None,
) -> dict[str, torch.Tensor]:
    """Load model, optimizer and tracked state in place; return the ``extra/`` tensors
    unprefixed. Without ``tracked`` the snapshot's tracked state is left unread (a tool
    that wants the parameters only); with it, the snapshot must track the same names.

    Everything is checked before anything is written, so a StateShapeError leaves the
    model, optimizer and tracked objects as they were.
    """
    meta = load_meta(state.meta)
    t = state.tensors
    entries = meta.get("tracked", [])
    expected = (
        {f"model/{k}" for k in meta["model"]}
        | {f"extra/{k}" for k in meta["extra"]}
        | {f"optim/groups/{gi}/{k}" for gi, ks in enumerate(meta["group_tensors"]) for k in ks}
        | {f"optim/{i}/{k}" for i, ks in meta["state_tensors"].items() for k in ks}
        | tensor_names(entries)
    )
    _same_names("snapshot tensors", expected, set(t), "meta lists", "tensors hold")
    live_model = model.state_dict()
    _same_names(
        "model state", set(live_model), set(meta["model"]), "the model has", "the snapshot has"
    )
    for key, live in live_model.items():
        _same_layout(f"model/{key}", live, t[f"model/{key}"])
    params, plans = _plan_optimizer(meta, t, optimizer)
    states = tracked.decode(entries, t) if tracked is not None else {}

    model.load_state_dict({k: t[f"model/{k}"] for k in live_model}, strict=True)
    placed = dict(_apply(plan) for plan in plans)
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, meta["groups"], strict=True)):
        members = group["params"]
        group.clear()
        group.update(saved)
        group.update({k: placed[f"optim/groups/{gi}/{k}"] for k in meta["group_tensors"][gi]})
        group["params"] = members
    for p in params.values():
        optimizer.state.pop(p, None)
    for i, plain in meta["state"].items():
        entry = {k: placed[f"optim/{i}/{k}"] for k in meta["state_tensors"][i]}
        entry.update(plain)
        optimizer.state[params[i]] = entry
    if tracked is not None:
        # Last: an object's load_state_dict may read the model or optimizer it belongs to.
        tracked.load(states)
    return {k: t[f"extra/{k}"] for k in meta["extra"]}


_Plan = tuple[torch.Tensor | None, torch.Tensor, torch.device, str]


def _plan_optimizer(
    meta: dict[str, Any], t: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[dict[int, torch.Tensor], list[_Plan]]:
    """Saved parameter index -> live parameter, and one copy plan per optimizer tensor."""
    groups, saved = optimizer.param_groups, meta["groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved]:
        raise StateShapeError(
            f"optimizer param groups: the optimizer has sizes {[len(g['params']) for g in groups]}"
            f", the snapshot has {[len(g['params']) for g in saved]}"
        )
    params = {
        i: p
        for g, s in zip(groups, saved, strict=True)
        for i, p in zip(s["params"], g["params"], strict=True)
    }
    unknown = set(meta["state"]) - set(params)
    if unknown:
        raise StateShapeError(
            f"optimizer state for parameter indices {sorted(unknown)} that no param group lists"
        )
    plans = []
    for gi, keys in enumerate(meta["group_tensors"]):
        for key in keys:
            name = f"optim/groups/{gi}/{key}"
            plans.append(_plan(name, groups[gi].get(key), t[name], t[name].device))
    group_of = {i: gi for gi, s in enumerate(saved) for i in s["params"]}
    for i, keys in meta["state_tensors"].items():
        p, group = params[i], saved[group_of[i]]
        # Optimizer's own policy: a non-capturable, non-fused "step" lives on the CPU.
        step_on = p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
        for key in keys:
            name = f"optim/{i}/{key}"
            plans.append(
                _plan(
                    name,
                    optimizer.state.get(p, {}).get(key),
                    t[name],
                    step_on if key == "step" else p.device,
                )
            )
    return params, plans


def params_sha256(model_state: Mapping[str, torch.Tensor], tracked_sha256: str | None) -> str:
    """sha256 over a model's state dict in key order (names and bytes), then the tracked
    state's hash when the job tracks any: the bit-identity check every member reports at
    the end, and what `keepstep checkpoint` checks an export against. With nothing tracked
    it is the model's alone (the same value as before tracked state existed)."""
    digest = hashlib.sha256()
    for key, value in model_state.items():
        digest.update(key.encode())
        # reshape(-1): a 0-dim tensor (BatchNorm's num_batches_tracked) has no byte view.
        raw = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    if tracked_sha256 is not None:
        digest.update(b"tracked:" + tracked_sha256.encode())
    return digest.hexdigest()


def layout_signature(model: torch.nn.Module) -> Layout:
    """Names, shapes and dtypes of the model's state, in state_dict order."""
    return [(k, tuple(v.shape), _dtype(v)) for k, v in model.state_dict().items()]


def check_layout(expected: Layout, model: torch.nn.Module) -> None:
    """StateShapeError naming every tensor that appeared, vanished or changed shape/dtype."""
    found = {name: (shape, dtype) for name, shape, dtype in layout_signature(model)}
    want = {name: (tuple(shape), dtype) for name, shape, dtype in expected}
    problems = [f"{n}: missing (expected {s} {d})" for n, (s, d) in want.items() if n not in found]
    problems += [f"{n}: new ({s} {d})" for n, (s, d) in found.items() if n not in want]
    problems += [
        f"{n}: expected {want[n][0]} {want[n][1]}, found {v[0]} {v[1]}"
        for n, v in found.items()
        if n in want and want[n] != v
    ]
    if problems:
        raise StateShapeError("model state layout changed: " + "; ".join(problems))


def _plan(name: str, live: object, src: torch.Tensor, device: torch.device) -> _Plan:
    """Copy into the live tensor when it has the same layout (keeps its identity, e.g. for
    captured graphs); a fresh optimizer has none, then a copy is made."""
    if isinstance(live, torch.Tensor):
        _same_layout(name, live, src)
        return live, src, live.device, name
    return None, src, device, name


def _apply(plan: _Plan) -> tuple[str, torch.Tensor]:
    live, src, device, name = plan
    with torch.no_grad():
        if live is None:
            return name, src.to(device=device, copy=True)
        live.copy_(src)
        return name, live


def _same_layout(name: str, live: torch.Tensor, found: torch.Tensor) -> None:
    if live.shape != found.shape or live.dtype != found.dtype:
        raise StateShapeError(
            f"{name}: expected {tuple(live.shape)} {_dtype(live)}, "
            f"found {tuple(found.shape)} {_dtype(found)} in the snapshot"
        )


def _same_names(what: str, a: set[str], b: set[str], a_says: str, b_says: str) -> None:
    if a != b:
        raise StateShapeError(
            f"{what} names differ: {a_says} {sorted(a - b)} only, {b_says} {sorted(b - a)} only"
        )


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _plain(value: Any, where: str) -> Any:
    """The value itself if it is built only of plain Python values; ConfigError if not."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]")
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(k, f"{where} key")
            _plain(v, f"{where}[{k!r}]")
        return value
    raise ConfigError(
        f"{where} is a {type(value).__name__}: a snapshot holds tensors and "
        "plain Python values (None, bool, int, float, str, containers) only"
    )


def load_meta(raw: bytes) -> dict[str, Any]:
    if raw[:1] == b"\x80":  # a pickle's first opcode
        raise SnapshotCorrupt(
            "snapshot meta is a pickle (written by keepstep before train state format 2); "
            "it is not read, since a snapshot may come from anywhere"
        )
    try:
        meta = plain_json.loads(raw)
    except plain_json.PlainJSONError as e:
        raise SnapshotCorrupt(f"unreadable snapshot meta: {e}") from e
    keys = {"format", "model", "groups", "group_tensors", "state", "state_tensors", "extra"}
    if not isinstance(meta, dict) or set(meta) - {"tracked"} != keys or meta["format"] != _FORMAT:
        raise SnapshotCorrupt(f"snapshot meta is not a keepstep train state of format {_FORMAT}")
    return meta
