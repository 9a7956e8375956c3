"""Which optimizers ZeRO-1 can shard, and rebuilding the user's optimizer over a shard.

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) takes the optimizer the script built
over the full parameters and rebuilds the same class, with the same param-group
hyper-parameters and implementation flags (``foreach``, ``fused``), over 1-D views of the
windows this rank steps. The script's optimizer stays the front: its ``param_groups`` hold
the hyper-parameters, so LR schedulers built on it keep working, and they are copied into
the shard's groups before every step.

What can be sharded
    An optimizer whose update of each element depends only on that element's parameter,
    gradient and state, plus per-tensor scalars that advance the same way for every
    element (the step count). Then stepping a slice gives the slice of the full step. That
    holds for the torch classes in ``ELEMENTWISE`` (the exact class: a subclass may change
    ``step``). Muon too: its momentum is elementwise, and its whole-matrix step runs
    where a shard touches the matrix (zero/muon.py). A list of optimizers
    (``OptimizerGroup``, e.g. Muon and AdamW) is sharded member by member. Refused, with
    the reason: LBFGS (closures, line search over the whole vector), SparseAdam and sparse
    gradients, Adafactor (rows and columns), ``differentiable=True`` (a graph through the
    step), and step hooks on the script's optimizer (the shard's step would not call them).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.optimizer_group import OptimizerGroup
from keepstep.elastic.step_guard import GuardHook
from keepstep.elastic.zero.muon import MUON, Finish, MuonWindows, check_muon

__all__ = ["ELEMENTWISE", "check_supported", "hyper", "load_states", "rebuild", "sync_groups"]

_O = torch.optim
# Per class: the state keys with one value per element (sliced by the shard). Every other
# key holds one value per tensor (0-d: step, mu_product, eta, mu).
ELEMENTWISE: Mapping[type[torch.optim.Optimizer], frozenset[str]] = {
    _O.SGD: frozenset({"momentum_buffer"}),
    _O.Adam: frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    _O.AdamW: frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    _O.Adamax: frozenset({"exp_avg", "exp_inf"}),
    _O.NAdam: frozenset({"exp_avg", "exp_avg_sq"}),
    _O.RAdam: frozenset({"exp_avg", "exp_avg_sq"}),
    _O.RMSprop: frozenset({"square_avg", "momentum_buffer", "grad_avg"}),
    _O.Adagrad: frozenset({"sum"}),
    _O.Adadelta: frozenset({"square_avg", "acc_delta"}),
    _O.ASGD: frozenset({"ax"}),
    _O.Rprop: frozenset({"prev", "step_size"}),
}

_WHY_NOT = {
    "LBFGS": "it re-evaluates a closure and searches along the whole parameter vector",
    "SparseAdam": "it steps sparse gradients, which have no element ranges to split",
    "Adafactor": "it factors the second moment over whole rows and columns",
}
_MUON_KEYS = frozenset({"momentum_buffer"})


def check_supported(optimizer: torch.optim.Optimizer) -> frozenset[str]:
    """The per-element state keys of ``optimizer``; ``ConfigError`` naming the optimizer and
    the reason if ZeRO-1 cannot shard it."""
    cls = type(optimizer)
    name = cls.__qualname__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"ZeRO-1 needs a torch.optim.Optimizer, got {name}")
    if isinstance(optimizer, OptimizerGroup):
        # Per-element keys never name a per-tensor value in another class: the union is
        # what every member's pieces are cut by.
        return frozenset().union(*(check_supported(o) for o in optimizer.optimizers))
    if MUON is not None and cls is MUON:
        check_muon(optimizer)
        keys: frozenset[str] | None = _MUON_KEYS
    else:
        keys = ELEMENTWISE.get(cls)
    if keys is None:
        supported = ", ".join(sorted([c.__name__ for c in ELEMENTWISE] + ["Muon"]))
        why = _WHY_NOT.get(name)
        if why is None:
            parent = next((c.__name__ for c in cls.__mro__[1:] if c in ELEMENTWISE), None)
            why = (
                f"it subclasses {parent}, and its step() may not be elementwise; build the "
                f"optimizer as torch.optim.{parent} itself"
                if parent
                else "its update is not known to be elementwise"
            )
        raise ConfigError(f"ZeRO-1 cannot shard {name}: {why}. Supported: {supported}")
    for gi, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ConfigError(
                f"ZeRO-1 cannot shard {name} with differentiable=True (param group {gi}): the "
                "step would need a graph through the full parameters"
            )
    hooks = [
        h
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
        for h in getattr(optimizer, attr, {}).values()
        if not isinstance(h, GuardHook)  # the job's own (step_guard.py)
    ]
    if hooks:
        raise ConfigError(
            f"{name} has {len(hooks)} step hook(s) (register_step_pre_hook/post_hook): under "
            "ZeRO-1 the script's optimizer never steps itself, so they would never run; "
            "remove them (keepstep's before_optimizer_step hooks still run)"
        )
    return keys


def hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: everything but its params."""
    return {k: v for k, v in group.items() if k != "params"}


def load_states(inner: torch.optim.Optimizer, states: Mapping[int, Mapping[str, Any]]) -> None:
    """Load ``states`` (by index in ``inner``'s parameter order) into a shard optimizer
    with its own groups' hyper-parameters, through torch's ``load_state_dict``: it copies
    the values and puts each on its window's device and dtype by torch's rules (a step
    count stays a float32 on the CPU unless the optimizer is fused or capturable)."""
    groups, start = [], 0
    for g in inner.param_groups:
        n = len(g["params"])
        groups.append({**hyper(g), "params": list(range(start, start + n))})
        start += n
    inner.load_state_dict({"state": dict(states), "param_groups": groups})


def rebuild(
    optimizer: torch.optim.Optimizer,
    shard_params: Sequence[Sequence[torch.Tensor]],
    finish: Finish | None = None,
) -> torch.optim.Optimizer:
    """The same optimizer class over ``shard_params[g]`` in param group ``g``, every group
    keeping its hyper-parameters (an empty group too, so group indices still match). A
    group of optimizers: each member rebuilt over its groups' windows. Muon: the windows'
    momentum, with ``finish`` to orthogonalise and apply (zero/muon.py)."""
    cls = type(optimizer)
    if len(shard_params) != len(optimizer.param_groups):
        raise ConfigError(
            f"{len(shard_params)} shard groups for {len(optimizer.param_groups)} param groups"
        )
    if isinstance(optimizer, OptimizerGroup):
        members, at = [], 0
        for member in optimizer.optimizers:
            n = len(member.param_groups)
            members.append(rebuild(member, shard_params[at : at + n], finish))
            at += n
        return OptimizerGroup(members)
    groups = [
        {**hyper(group), "params": list(params)}
        for group, params in zip(optimizer.param_groups, shard_params, strict=True)
    ]
    if MUON is not None and cls is MUON:
        return MuonWindows(groups, optimizer.defaults, finish)
    # Only the constructor's own arguments (AdamW's defaults carry decoupled_weight_decay,
    # which its __init__ does not take); each group holds its complete set anyway.
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls(groups, **kwargs)


def sync_groups(front: torch.optim.Optimizer, shard: torch.optim.Optimizer) -> None:
    """Copy the front optimizer's hyper-parameters (moved by LR schedulers, or by the
    script) into the shard's groups; refuse groups added after the shard was built."""
    if len(front.param_groups) != len(shard.param_groups):
        raise ConfigError(
            f"the optimizer has {len(front.param_groups)} param groups, the shard was built "
            f"for {len(shard.param_groups)}: add param groups before sharding"
        )
    for group, mine in zip(front.param_groups, shard.param_groups, strict=True):
        for key, value in group.items():
            if key != "params":
                mine[key] = value
