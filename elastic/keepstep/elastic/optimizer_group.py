"""Several optimizers stepped as one: Muon for the matrices and AdamW for the rest.

Where it sits: ``keepstep.init(model, [muon, adamw], ...)`` wraps the list in an
``OptimizerGroup`` and the Job holds it where it holds a single optimizer. What the Job
asks of an optimizer, the group answers for all of its members, in their order:

- ``param_groups``: the members' groups, concatenated (the same dicts, so an LR scheduler
  built on a member changes the lr the group shows and the snapshot keeps);
- ``state``: a view that reads and writes each parameter's state in its own member;
- ``step()`` steps every member; ``zero_grad()`` clears every member's gradients;
- ``state_dict()``: torch's packed format over the concatenated groups (parameter indices
  counted on across members), which is exactly what ``torch.optim.Optimizer.state_dict``
  would give for one optimizer holding all the groups; ``load_state_dict`` splits it back.

So snapshots, checkpoints, grad scaling (``scaler.unscale_(group)`` walks the groups) and
clipping work unchanged. A parameter may belong to one member only: two optimizers
stepping the same tensor would each apply their update to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError

__all__ = ["OptimizerGroup", "as_optimizer"]


class _RoutedState(MutableMapping[torch.Tensor, Any]):
    """The members' ``state`` dicts read and written as one, keyed by parameter."""

    def __init__(self, owner: Mapping[torch.Tensor, torch.optim.Optimizer]) -> None:
        self._owner = owner

    def _member(self, p: torch.Tensor) -> torch.optim.Optimizer:
        try:
            return self._owner[p]
        except KeyError:
            raise KeyError("the parameter belongs to no optimizer of the group") from None

    def __getitem__(self, p: torch.Tensor) -> Any:
        return self._member(p).state[p]  # a member's defaultdict: {} for one not stepped yet

    def __setitem__(self, p: torch.Tensor, value: Any) -> None:
        self._member(p).state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._member(p).state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        seen = {id(o): o for o in self._owner.values()}
        for member in seen.values():
            yield from list(member.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p: object) -> bool:
        member = self._owner.get(p) if isinstance(p, torch.Tensor) else None
        return member is not None and p in member.state


class OptimizerGroup(torch.optim.Optimizer):
    """``optimizers`` (at least one, no parameter in two) stepped as one optimizer.

    Not built through ``torch.optim.Optimizer.__init__``: its parameter groups and state
    are its members', never copies.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        members = list(optimizers)
        if not members:
            raise ConfigError("optimizer=[]: give at least one torch.optim.Optimizer")
        owner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        where: dict[torch.Tensor, int] = {}
        for i, opt in enumerate(members):
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(
                    f"optimizer[{i}] is a {type(opt).__name__}: every item must be a "
                    "torch.optim.Optimizer"
                )
            if isinstance(opt, OptimizerGroup):
                raise ConfigError(f"optimizer[{i}] is itself an OptimizerGroup: list its members")
            for group in opt.param_groups:
                for p in group["params"]:
                    if p in owner and owner[p] is not opt:
                        raise ConfigError(
                            f"a parameter of shape {tuple(p.shape)} is in optimizer[{where[p]}] "
                            f"({type(owner[p]).__name__}) and optimizer[{i}] "
                            f"({type(opt).__name__}): each would apply its update to it. "
                            "Give every parameter to one optimizer"
                        )
                    owner[p], where[p] = opt, i
        self.optimizers = members
        self.defaults: dict[str, Any] = {}
        self._owner = owner
        self._state = _RoutedState(owner)
        # What torch.optim.Optimizer's own methods and profilers look up on any optimizer.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        raise ConfigError("an OptimizerGroup's param groups are its members': set them there")

    @property  # type: ignore[override]
    def state(self) -> MutableMapping[torch.Tensor, Any]:
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        raise ConfigError("an OptimizerGroup's state is its members': set it there")

    def owner_of(self, group_index: int) -> torch.optim.Optimizer:
        """The member whose param group is ``param_groups[group_index]``."""
        i = group_index
        for opt in self.optimizers:
            if i < len(opt.param_groups):
                return opt
            i -= len(opt.param_groups)
        raise IndexError(f"param group {group_index}: the group has {len(self.param_groups)}")

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ConfigError("an OptimizerGroup steps without a closure (LBFGS is not a member)")
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("add a param group to one of the group's optimizers, not the group")

    def state_dict(self) -> dict[str, Any]:
        groups: list[dict[str, Any]] = []
        state: dict[int, Any] = {}
        offset = 0
        for opt in self.optimizers:
            packed = opt.state_dict()
            for group in packed["param_groups"]:
                groups.append({**group, "params": [offset + i for i in group["params"]]})
            for i, per_param in packed["state"].items():
                state[offset + i] = per_param
            offset += sum(len(g["params"]) for g in packed["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        groups, state = list(state_dict["param_groups"]), state_dict["state"]
        sizes = [len(g["params"]) for opt in self.optimizers for g in opt.param_groups]
        saved = [len(g["params"]) for g in groups]
        if saved != sizes:
            raise ConfigError(
                f"optimizer state for param groups of sizes {saved}; this group's optimizers "
                f"have {sizes}"
            )
        offset = 0
        for opt in self.optimizers:
            mine, groups = groups[: len(opt.param_groups)], groups[len(opt.param_groups) :]
            count = sum(len(g["params"]) for g in mine)
            opt.load_state_dict(
                {
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in mine
                    ],
                    "state": {
                        int(i) - offset: s
                        for i, s in state.items()
                        if offset <= int(i) < offset + count
                    },
                }
            )
            offset += count

    def __repr__(self) -> str:
        names = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"OptimizerGroup({names})"


def as_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """What ``keepstep.init`` takes as its optimizer, as one: an optimizer as is, a list or
    tuple of them as an ``OptimizerGroup`` (one item: that optimizer)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, (list, tuple)):
        members = list(optimizer)
        if len(members) == 1 and isinstance(members[0], torch.optim.Optimizer):
            return members[0]
        return OptimizerGroup(members)
    raise ConfigError(
        f"optimizer={optimizer!r}: must be a torch.optim.Optimizer or a list of them "
        "(e.g. [Muon(matrices), AdamW(the rest)])"
    )
