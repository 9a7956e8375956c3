"""ZeRO-1: step the owned elements only, keep optimizer state for them only, all-gather.

Where it sits: after the exact reduction has put the same averaged gradient into every
member's ``.grad`` (reduce.py), ``ZeroOptimizer.step`` replaces the full optimizer step:

    copy hyper-parameters from the script's optimizer (LR schedulers move them there)
    -> step the shard optimizer on this rank's windows (zero/ownership.py)
    -> all-gather the owned pieces of the parameters: every rank ends with all of them

The result is bit-identical to the script's optimizer stepping the full parameters, at any
world size: the update is elementwise (zero/optimizers.py says which classes qualify),
the shard optimizer is the same class with the same flags (``foreach``/``fused``: the
same kernels), and windows put every element at the same place in the kernels' vector
loops as the full step does. With more than one intra-op thread the full step cuts a
large tensor between threads where no window can follow; the measured difference is in
bf16/fp16 only, and such a job is refused (float32 stays identical in our tests).
Muon's whole-matrix part is the exception that the finisher ``_orthogonalize`` handles:
each matrix is stepped whole on one rank (zero/muon.py, zero/matrices.py).

State: each rank keeps optimizer state for its windows only, about ``1/W`` of the full
state. ``state_dict``/``load_state_dict`` are the shard's (what a member's snapshot
holds: its owned pieces); ``full_state_dict`` gathers the state in torch's own format
(the optimizer-state hash, durable checkpoints), ``load_full_state_dict`` cuts one.

A step that raises (``PeerLost`` in the gather) leaves the parameters part updated and
the shard state advanced: the step must not commit, and the job restores its snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from keepstep.elastic.errors import ConfigError, StateShapeError
from keepstep.elastic.optimizer_group import OptimizerGroup
from keepstep.elastic.zero.clip import clip_windows
from keepstep.elastic.zero.gather import Gather, allgather_ragged
from keepstep.elastic.zero.matrices import WholeMatrices
from keepstep.elastic.zero.muon import MUON
from keepstep.elastic.zero.optimizers import (
    check_supported,
    hyper,
    load_states,
    rebuild,
    sync_groups,
)
from keepstep.elastic.zero.ownership import ALIGN, Ownership, windows
from keepstep.elastic.zero.pieces import PieceGather, check_speeds
from keepstep.elastic.zero.state import join_pieces, pack_owned, slice_state, unpack_full

__all__ = ["ZeroOptimizer", "state_bytes"]

_GRAIN = 32768  # torch's intra-op grain: a tensor this large may be cut between threads
_REDUCED = (torch.bfloat16, torch.float16)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of `optimizer`'s state: the storage behind its tensors, each counted once."""
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    }
    return sum(storages.values())


class ZeroOptimizer:
    """The script's ``optimizer`` stepped as ZeRO-1 over ``gather``'s ranks.

    ``params`` are the tensors whose flattened concatenation ``ownership`` cuts (in that
    order, e.g. the job's parameters); every parameter of ``optimizer`` must be among
    them. ``optimizer`` stays the front (its ``param_groups`` hold the hyper-parameters);
    its state, if any, moves into the shards, and it must not step by itself.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        ownership: Ownership,
        gather: Gather,
        *,
        timeout: timedelta = timedelta(seconds=60),
        align: int = ALIGN,
    ) -> None:
        self.keys = check_supported(optimizer)
        self.params = list(params)
        self.optimizer = optimizer
        self.ownership = ownership
        self.gather = gather
        self.timeout = timeout
        self.rank = gather.rank
        name = type(optimizer).__qualname__
        if ownership.world != gather.size:
            raise ConfigError(f"ownership has {ownership.world} ranks, the gather {gather.size}")
        sizes = tuple(p.numel() for p in self.params)
        if sizes != ownership.sizes:
            raise ConfigError(f"params have sizes {sizes[:8]}, ownership {ownership.sizes[:8]}")
        index = {id(p): t for t, p in enumerate(self.params)}
        if len(index) != len(self.params):
            raise ConfigError("params lists a tensor twice")
        self._group_of: dict[int, int] = {}
        self._opt_index: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                t = index.get(id(p))
                if t is None:
                    raise ConfigError(
                        f"{name} param group {g} holds a tensor of shape {tuple(p.shape)} that "
                        "is not among the sharded params"
                    )
                self._group_of[t] = g
                self._opt_index[t] = len(self._opt_index)
        self._check_tensors(name)
        self.windows = windows(ownership, self.rank, self._group_of, align)
        # 1-D views of the parameters: the shard optimizer writes into them in place.
        self._views = [self._flat(w.tensor)[w.start : w.stop] for w in self.windows]
        per_group: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for w, view in zip(self.windows, self._views, strict=True):
            per_group[self._group_of[w.tensor]].append(view)
        self._inner_index = {id(v): i for i, v in enumerate(v for g in per_group for v in g)}
        self.inner = rebuild(optimizer, per_group, self._orthogonalize)
        self._attached = False  # attach_grads gave the next step its gradients
        self._pieces = PieceGather(gather, ownership, [p.element_size() for p in self.params])
        self._stepped = frozenset(self._group_of)  # the tensors this optimizer steps
        # Muon's matrices (zero/muon.py): each is stepped whole on the rank designated for it.
        muon = frozenset(t for t, g in self._group_of.items() if _is_muon(optimizer, g))
        self._matrices = WholeMatrices(self.params, muon, self.windows, self._views, self._pieces)
        self._given: frozenset[int] = frozenset()  # the tensors with a gradient this step
        self._speeds: list[float] | None = None  # the ranks' speeds for whole-tensor work
        if optimizer.state:  # a resumed script, or Adagrad's state made at construction
            self.load_full_state_dict(optimizer.state_dict())
        optimizer.state.clear()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> None:
        """One optimizer step on the owned elements, then the all-gather of parameters.

        The gradient comes from the parameters' ``.grad`` (ZeRO-1: every member holds the
        reduced gradient), or from ``attach_grads`` (ZeRO-2, zero/grads.py)."""
        if self.optimizer.state:
            raise ConfigError(
                f"{type(self.optimizer).__qualname__} holds state of its own (it stepped, or "
                "loaded a state dict): under ZeRO-1 its state lives in the shards; step with "
                "ZeroOptimizer.step, load with ZeroOptimizer.load_full_state_dict"
            )
        sync_groups(self.optimizer, self.inner)
        if not self._attached:
            for view, grad in zip(self._views, self._grads_from_params(), strict=True):
                view.grad = grad
            if self._matrices.matrices:  # only Muon's whole-matrix step reads it
                self._given = frozenset(t for t, p in enumerate(self.params) if p.grad is not None)
        self._attached = False
        try:
            self.inner.step()
        finally:
            for view in self._views:
                view.grad = None
        # What torch's LR-scheduler wrapper of optimizer.step records: schedulers built on
        # the front optimizer (or on a member of a group) then see it stepped, and do not warn.
        for stepped in (self.optimizer, *getattr(self.optimizer, "optimizers", ())):
            setattr(stepped, "_opt_called", True)  # noqa: B010
        self.gather_params()

    def _orthogonalize(self, updates: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Muon's finisher: its matrices stepped whole (zero/matrices.py)."""
        groups = {t: self.inner.param_groups[self._group_of[t]] for t in self._matrices.mine}
        self._matrices.step(updates, self._given, groups, self.timeout)

    def _grads_from_params(self) -> list[torch.Tensor | None]:
        """Each window's slice of its parameter's ``.grad`` (a view; None without one)."""
        flat: dict[int, torch.Tensor | None] = {}
        for w in self.windows:
            if w.tensor not in flat:
                grad = self.params[w.tensor].grad
                if grad is not None and grad.layout != torch.strided:
                    raise ConfigError(f"tensor {w.tensor} has a {grad.layout} gradient")
                flat[w.tensor] = None if grad is None else grad.reshape(-1)
        return [
            None if (g := flat[w.tensor]) is None else g[w.start : w.stop] for w in self.windows
        ]

    def attach_grads(
        self, grads: Sequence[torch.Tensor | None], given: Sequence[int] | None = None
    ) -> None:
        """The windows' gradients for the next ``step``, one per window (ZeRO-2's,
        zero/grads.py), in place of the parameters' ``.grad``. ``inner`` holds them
        until the step (a grad scaler unscales them there). ``given[t]``: whether some
        micro-batch gave tensor t a gradient; needed when Muon steps matrices whole (the
        rank that steps one may hold none of its gradient)."""
        if len(grads) != len(self.windows):
            raise ConfigError(f"{len(grads)} gradients for {len(self.windows)} windows")
        if given is None and self._matrices.matrices and self.ownership.world > 1:
            raise ConfigError("attach_grads needs given= when Muon steps matrices whole")
        if given is not None and len(given) != len(self.params):
            raise ConfigError(f"{len(given)} counts for {len(self.params)} tensors")
        if given is not None:
            self._given = frozenset(t for t, n in enumerate(given) if n > 0)
        else:  # one rank: its windows cover every tensor
            pairs = zip(self.windows, grads, strict=True)
            self._given = frozenset(w.tensor for w, g in pairs if g is not None)
        for view, grad in zip(self._views, grads, strict=True):
            view.grad = grad
        self._attached = True

    @property
    def stepped(self) -> frozenset[int]:
        """The tensors the optimizer steps (indices into ``params``)."""
        return self._stepped

    def set_speeds(self, speeds: Sequence[float] | None) -> None:
        """The ranks' relative speeds (one per rank, > 0; None: equal), for the work done
        whole on one rank (Muon's Newton-Schulz, a tensor's norm when clipping): a slow
        rank gets less of it. Between steps, the same on every rank; the bits do not
        depend on it."""
        self._speeds = check_speeds(speeds, self.ownership.world) if speeds else None
        self._matrices.designate(self._speeds)

    @property
    def designated(self) -> dict[int, int]:
        """The rank that steps each of Muon's matrices whole (by tensor index)."""
        return dict(self._matrices.designated)

    def clip_attached(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients ``attach_grads`` gave (ZeRO-2's windows) as
        ``clip_grad_norm_(params, max_norm, foreach=False)`` clips the whole gradient, with
        the same bits, without gathering it (zero/clip.py); the total norm. A collective."""
        if not self._attached:
            raise ConfigError("clip_attached clips the gradients attach_grads gave")
        grads = [view.grad for view in self._views]
        return clip_windows(
            self._pieces,
            self.params,
            self.windows,
            grads,
            self._given,
            max_norm,
            self.timeout,
            self._speeds,
        )

    def gather_grads(self, grads: Sequence[torch.Tensor | None], given: Sequence[int]) -> None:
        """Every rank's window gradients into full ``.grad`` tensors (a collective), as
        ZeRO-1 holds them: for a job whose clipping or hooks read the whole gradient.
        ``given[t]``: whether some micro-batch gave tensor t a gradient (else None)."""
        if len(grads) != len(self.windows) or len(given) != len(self.params):
            raise ConfigError(
                f"{len(grads)} gradients for {len(self.windows)} windows, {len(given)} "
                f"counts for {len(self.params)} tensors"
            )
        full = {t: torch.zeros_like(self.params[t]).view(-1) for t in self._group_of}
        for w, grad in zip(self.windows, grads, strict=True):
            if grad is not None:
                for r in w.owned:
                    full[w.tensor][r.start : r.stop] = grad[r.start - w.start : r.stop - w.start]
        self._pieces.run(lambda t: full[t].view(torch.uint8), self._stepped, self.timeout)
        for t, p in enumerate(self.params):
            p.grad = full[t].view(p.shape) if t in full and given[t] > 0 else None

    def gather_params(self) -> None:
        """Every rank's owned pieces of the parameters, into every rank's parameters
        (Muon's matrices whole, from the rank that stepped them)."""
        self._pieces.run(self._bytes, self._stepped, self.timeout, whole=self._matrices.designated)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The script's optimizer's param groups (where the hyper-parameters live)."""
        return self.optimizer.param_groups

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard in torch's optimizer format, over its owned pieces.

        ``pieces[i] = [tensor, start, stop]`` (offsets in that flattened tensor; an empty
        tensor this rank anchors is ``[tensor, 0, 0]``); ``state[i]`` its per-element
        values (1-D views, not copies) and per-tensor values; ``param_groups`` the
        hyper-parameters with the indices of their pieces. Scratch lanes are left out.
        """
        state: dict[int, dict[str, Any]] = {}
        pieces: list[list[int]] = []
        groups = [{**hyper(g), "params": []} for g in self.optimizer.param_groups]
        for w, view in zip(self.windows, self._views, strict=True):
            window_state = self.inner.state.get(view)
            for r in w.owned or ((0, 0),):
                i = len(pieces)
                pieces.append([w.tensor, r[0], r[1]])
                groups[self._group_of[w.tensor]]["params"].append(i)
                if window_state:
                    state[i] = slice_state(window_state, self.keys, r[0] - w.start, r[1] - w.start)
        return {"state": state, "param_groups": groups, "pieces": pieces}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Put back a shard from ``state_dict`` (this rank's, under the same ownership)."""
        mine = self.state_dict()
        pieces = state_dict.get("pieces")
        if pieces is not None and [list(p) for p in pieces] != mine["pieces"]:
            raise StateShapeError(
                f"rank {self.rank}: the shard holds pieces {list(pieces)[:4]}, this rank owns "
                f"{mine['pieces'][:4]}; another ownership needs load_full_state_dict"
            )
        groups = self._check_groups(state_dict, [len(g["params"]) for g in mine["param_groups"]])
        saved = state_dict.get("state", {})
        windows: dict[int, dict[str, Any]] = {}
        i = 0
        for w, view in zip(self.windows, self._views, strict=True):
            n = max(len(w.owned), 1)
            joined = join_pieces(w, [saved.get(j, {}) for j in range(i, i + n)], self.keys)
            i += n
            if joined is not None:
                windows[self._inner_index[id(view)]] = joined
        self._load_windows(windows, groups)

    def full_state_dict(self) -> dict[str, Any]:
        """The full optimizer state in the format of the script's optimizer's
        ``state_dict()``, as an unsharded step would have it. A collective: every rank
        calls it, every rank gets it."""
        states = [self.inner.state.get(v, {}) for v in self._views]
        device = self.gather.device
        mine = pack_owned(self.windows, states, self.params, self.keys, device)
        # A bound on any rank's payload (8 bytes per value and key, a header entry per
        # window), checked before the buffers are allocated.
        values = (self.ownership.total + len(self.params)) * (len(self.keys) + 1)
        limit = 16 * values + 512 * (len(self.windows) + 1) * self.gather.size + (1 << 20)
        slots = allgather_ragged(self.gather, mine, self.timeout, limit)
        by_tensor = unpack_full(slots, self.ownership, self.params, self.keys)
        state = {self._opt_index[t]: s for t, s in by_tensor.items()}
        groups = self.optimizer.state_dict()["param_groups"]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_full_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Cut this rank's shard out of a full state (``full_state_dict``, or the script's
        optimizer's ``state_dict()``); its hyper-parameters go to the script's optimizer."""
        saved = state_dict.get("state", {})
        states: list[Mapping[str, Any]] = []
        for w in self.windows:
            full = saved.get(self._opt_index[w.tensor])
            if not full:
                states.append({})
                continue
            for key in self.keys & set(full):
                if full[key].numel() != self.params[w.tensor].numel():
                    i, n = self._opt_index[w.tensor], self.params[w.tensor].numel()
                    raise StateShapeError(
                        f"state {key!r} of parameter {i} has {full[key].numel()} elements, "
                        f"the parameter {n}"
                    )
            states.append(slice_state(full, self.keys, w.start, w.stop))
        self.load_window_states(states, state_dict.get("param_groups"))

    def load_window_states(self, states: Sequence[Mapping[str, Any]], groups: Any) -> None:
        """This rank's state window by window, in ``needed()`` order (each a window's flat
        per-element values and its tensor's per-tensor ones; empty for a parameter without
        state yet), and the script's ``param_groups`` (their hyper-parameters go to the
        script's optimizer). No parameter's full state is needed: a sharded job joins its
        windows from snapshot pieces (snapshot_shard.join_windows)."""
        counts = [len(g["params"]) for g in self.param_groups]
        checked = self._check_groups({"param_groups": groups}, counts)
        if len(states) != len(self.windows):
            raise StateShapeError(f"{len(states)} window states for {len(self.windows)} windows")
        windows: dict[int, dict[str, Any]] = {}
        for view, state in zip(self._views, states, strict=True):
            if state:
                windows[self._inner_index[id(view)]] = dict(state)
        self._load_windows(windows, checked)

    # -- figures ----------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its windows, scratch lanes included)."""
        return state_bytes(self.inner)

    def needed(self) -> list[tuple[int, int, int]]:
        """``(index, start, stop)`` for every window: the elements of the script's
        optimizer's parameter ``index`` (its state_dict order) whose state this rank
        loads (owned pieces and their scratch lanes)."""
        return [(self._opt_index[w.tensor], w.start, w.stop) for w in self.windows]

    def owned_elements(self) -> int:
        return sum(r.size for w in self.windows for r in w.owned)

    # -- helpers ----------------------------------------------------------------------
    def _flat(self, t: int) -> torch.Tensor:
        return self.params[t].detach().view(-1)

    def _bytes(self, t: int) -> torch.Tensor:
        return self._flat(t).view(torch.uint8)

    def _check_tensors(self, name: str) -> None:
        devices = {self.params[t].device for t in self._group_of}
        if len(devices) > 1:
            raise ConfigError(f"{name}'s parameters are on {sorted(map(str, devices))}: use one")
        threads = torch.get_num_threads()
        for t in self._group_of:
            p = self.params[t]
            if p.layout != torch.strided or not p.is_contiguous():
                raise ConfigError(f"parameter {t} (shape {tuple(p.shape)}) must be contiguous")
            if not (p.is_floating_point() or p.is_complex()):
                raise ConfigError(f"parameter {t} has dtype {p.dtype}; ZeRO-1 steps float tensors")
            cut = threads > 1 and p.device.type == "cpu"  # a GPU's kernels run per element
            if cut and p.dtype in _REDUCED and p.numel() > _GRAIN:
                raise ConfigError(
                    f"parameter {t} ({p.dtype}, {p.numel()} elements) with {threads} intra-op "
                    "threads: torch cuts it between threads where a shard cannot follow, and "
                    f"{p.dtype} rounds differently there; use threads=1 (the job's default)"
                )

    def _check_groups(self, state_dict: Mapping[str, Any], counts: list[int]) -> list[Any]:
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != counts:
            got = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else groups
            raise StateShapeError(f"the state has param groups of sizes {got}, expected {counts}")
        return groups

    def _load_windows(self, windows: dict[int, dict[str, Any]], groups: list[Any]) -> None:
        # Own, compact copies: a per-tensor value (a step count) shared by several windows
        # would be stepped once per window, and torch's deepcopy of a view copies the whole
        # tensor it views.
        own = {i: {k: _own(v) for k, v in s.items()} for i, s in windows.items()}
        load_states(self.inner, own)
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(hyper(saved))
        sync_groups(self.optimizer, self.inner)


def _is_muon(optimizer: torch.optim.Optimizer, group: int) -> bool:
    """Whether param group ``group`` is stepped by ``torch.optim.Muon`` (a member's, in a
    group of optimizers)."""
    if isinstance(optimizer, OptimizerGroup):
        optimizer = optimizer.owner_of(group)
    return MUON is not None and type(optimizer) is MUON


def _own(value: Any) -> Any:
    return value.clone(memory_format=torch.contiguous_format) if torch.is_tensor(value) else value
