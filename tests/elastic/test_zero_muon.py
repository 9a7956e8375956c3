"""Muon under ZeRO (zero/muon.py) gives the unsharded step's bits at any world size: alone,
and beside AdamW in a group of optimizers, as a script with Muon for the hidden matrices
and AdamW for the rest builds it.

As in test_zero.py, every case trains the same parameters twice on the same gradients:
once with the script's optimizers on the full parameters (the reference), once sharded
over W ranks on threads of this process (the ``LocalGathers`` fake). The sha256 of the
parameters and of the gathered optimizer state must be equal.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch
from torch.optim import _muon as torch_muon
from zero_scenario import TIMEOUT, on_threads, params_sha, state_sha

from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.optimizer_group import OptimizerGroup
from keepstep.elastic.shard import Range
from keepstep.elastic.snapshot_shard import PieceKey
from keepstep.elastic.zero import LocalGathers, Ownership, ZeroOptimizer
from keepstep.elastic.zero import matrices as zero_matrices
from keepstep.elastic.zero.muon import designate, ns_cost, scales_its_input
from keepstep.elastic.zero.replicas import ReplicaSteps

# Matrices wide, tall and square (Newton-Schulz transposes a tall one), and the vectors and
# scalars a model has beside them (AdamW's in the group).
SHAPES: list[tuple[int, ...]] = [(37, 5), (300,), (64, 48), (1,), (5, 300), (), (33, 33)]
MATRICES = [0, 2, 4, 6]
STEPS = 3


def muon_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _muon(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Two param groups: nesterov with the default lr scaling, and plain momentum with
    AdamW's rms matching and its own lr and weight decay."""
    first, second = [params[i] for i in MATRICES[:2]], [params[i] for i in MATRICES[2:]]
    groups: list[dict[str, Any]] = [
        {"params": first},
        {
            "params": second,
            "nesterov": False,
            "lr": 0.01,
            "weight_decay": 0.2,
            "adjust_lr_fn": "match_rms_adamw",
        },
    ]
    return torch.optim.Muon(groups, lr=0.02, momentum=0.9)


def _group(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    rest = [p for i, p in enumerate(params) if i not in MATRICES]
    return OptimizerGroup([_muon(params), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1)])


def _muon_only(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return _muon(params)


BUILDS = {"muon": _muon_only, "muon+adamw": _group}


def muon_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The reduced gradient of ``step``; matrix 2 has none at step 0 (Muon skips it)."""
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = None if (i == 2 and step == 0) else grad


def _sizes() -> tuple[int, ...]:
    return tuple(int(torch.Size(s).numel()) for s in SHAPES)


def chunked(world: int, chunk: int) -> Ownership:
    """Rank r owns chunks r, r + W, ...: matrices cut between several ranks."""
    total = sum(_sizes())
    ranges: list[list[Range]] = [[] for _ in range(world)]
    for i, start in enumerate(range(0, total, chunk)):
        ranges[i % world].append(Range(start, min(start + chunk, total)))
    return Ownership(_sizes(), tuple(tuple(r) for r in ranges))


def reference(name: str, dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    params = muon_params(dtype)
    opt = BUILDS[name](params)
    for step in range(STEPS):
        muon_grads(params, step)
        opt.step()
    assert not torch.equal(params[0], muon_params(dtype)[0])  # it stepped
    return params_sha(params), state_sha(opt.state_dict())


def _sharded(name: str, ownership: Ownership, dtype: torch.dtype = torch.float32) -> set[Any]:
    def member(rank: int, gather: Any) -> tuple[str, str]:
        params = muon_params(dtype)
        zero = ZeroOptimizer(params, BUILDS[name](params), ownership, gather, timeout=TIMEOUT)
        for step in range(STEPS):
            muon_grads(params, step)
            zero.step()
        return params_sha(params), state_sha(zero.full_state_dict())

    return set(on_threads(ownership.world, member))


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_sharded_muon_matches_the_unsharded_step(name: str) -> None:
    want = reference(name)
    for ownership in (
        Ownership.balanced(_sizes(), 1),
        Ownership.balanced(_sizes(), 3),
        chunked(4, 97),  # every matrix in pieces on several ranks
    ):
        assert _sharded(name, ownership) == {want}, f"{name} at W={ownership.world}"


def test_sharded_muon_matches_in_bf16() -> None:
    if scales_its_input(torch_muon._zeropower_via_newtonschulz):  # an older torch (2.11)
        with pytest.raises(ConfigError, match=r"group 1 \(bfloat16 matrices, nesterov=False\)"):
            _sharded("muon+adamw", chunked(3, 61), torch.bfloat16)
        return
    want = reference("muon+adamw", torch.bfloat16)
    assert _sharded("muon+adamw", chunked(3, 61), torch.bfloat16) == {want}


def _scaling_newton_schulz(grad: torch.Tensor, *args: Any) -> torch.Tensor:
    """Newton-Schulz as torch 2.11 wrote it: a bfloat16 input is scaled in place."""
    ortho = grad.bfloat16()
    ortho.div_(ortho.norm().clamp(min=1e-7))
    return ortho


def test_plain_momentum_on_bf16_is_refused_where_torch_rescales_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch's Newton-Schulz scales a bfloat16 input in place, its Muon step (not
    nesterov) rescales the momentum buffer itself: the sharded step, which hands it a
    gathered copy, would not. Refused by name; nesterov and float32 are unaffected."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _scaling_newton_schulz)
    assert scales_its_input(_scaling_newton_schulz)
    params = muon_params(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"Muon param group 1 \(bfloat16 matrices, nesterov="):
        ZeroOptimizer(
            params, _muon(params), Ownership.balanced(_sizes(), 1), LocalGathers(1).rank(0)
        )
    nesterov = torch.optim.Muon([params[i] for i in MATRICES], lr=0.02)
    ZeroOptimizer(params, nesterov, Ownership.balanced(_sizes(), 1), LocalGathers(1).rank(0))
    wide = muon_params(torch.float32)
    ZeroOptimizer(wide, _muon(wide), Ownership.balanced(_sizes(), 1), LocalGathers(1).rank(0))


def test_each_rank_keeps_only_its_share_of_the_momentum() -> None:
    matrix_elements = sum(_sizes()[i] for i in MATRICES)

    def member(rank: int, gather: Any) -> int:
        params = muon_params()
        zero = ZeroOptimizer(params, _muon(params), Ownership.balanced(_sizes(), 4), gather)
        muon_grads(params, 1)
        zero.step()
        return zero.state_bytes()

    per_rank = on_threads(4, member)
    assert max(per_rank) < 4 * matrix_elements / 4 * 1.5, per_rank  # fp32, plus scratch lanes
    assert sum(per_rank) >= 4 * matrix_elements


def test_a_replica_steps_the_momentum_its_owner_steps() -> None:
    """zero/replicas.py: a member that keeps another's pieces steps their momentum itself;
    the parameters are its owner's to write."""
    params = muon_params()
    opt = _muon(params)
    muon_grads(params, 0)
    opt.step()  # the state a replica was given at the epoch's first commit
    order = [p for g in opt.param_groups for p in g["params"]]
    keys = [PieceKey(0, 3, 150), PieceKey(2, 1000, 2000), PieceKey(3, 0, 1089)]
    given = {
        k: {
            "momentum_buffer": opt.state[order[k.param]]["momentum_buffer"]
            .reshape(-1)[k.start : k.stop]
            .clone()
        }
        for k in keys
    }
    replica = ReplicaSteps(opt, given, frozenset({"momentum_buffer"}))
    muon_grads(params, 1)
    before = [p.detach().clone() for p in params]
    replica.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    opt.step()
    for key, state in replica.pieces().items():
        full = opt.state[order[key.param]]["momentum_buffer"].reshape(-1)[key.start : key.stop]
        assert torch.equal(state["momentum_buffer"], full), key


def test_what_sharded_muon_cannot_step_is_refused_by_name() -> None:
    params = muon_params()
    gather = LocalGathers(1).rank(0)
    own = Ownership.balanced(_sizes(), 1)
    muon = _muon(params)
    muon.param_groups[0]["params"].append(params[1])  # a vector added behind its back
    with pytest.raises(
        ConfigError, match=re.escape("Muon param group 0 holds a tensor of shape (300,)")
    ):
        ZeroOptimizer(params, muon, own, gather)
    with pytest.raises(ConfigError, match="cannot shard Adafactor: it factors"):
        rest = [p for i, p in enumerate(params) if i not in MATRICES]
        ZeroOptimizer(
            params, OptimizerGroup([_muon(params), torch.optim.Adafactor(rest)]), own, gather
        )


def test_each_matrix_is_given_to_one_rank_the_largest_first() -> None:
    shapes = {0: (64, 48), 2: (5, 300), 4: (33, 33), 7: (128, 128), 9: (10, 10)}
    got = designate(shapes, 3)
    assert got == designate(dict(reversed(shapes.items())), 3)  # a function of the shapes
    assert got[7] == 0 and got[0] == 1  # the costliest two first, on empty ranks
    load = [sum(ns_cost(shapes[t]) for t, r in got.items() if r == rank) for rank in range(3)]
    assert max(load) == ns_cost((128, 128))  # nothing joins the largest: it is the bound
    assert ns_cost((5, 300)) == ns_cost((300, 5)) == 2 * 25 * 300 + 125
    assert designate(shapes, 1) == dict.fromkeys(shapes, 0)


def test_a_slow_rank_is_given_less_newton_schulz_work() -> None:
    shapes = {0: (64, 48), 2: (5, 300), 4: (33, 33), 7: (128, 128), 9: (10, 10)}
    assert designate(shapes, 3, [1.0, 1.0, 1.0]) == designate(shapes, 3)  # equal: by load
    got = designate(shapes, 3, [1.0, 0.1, 1.0])
    load = [sum(ns_cost(shapes[t]) for t, r in got.items() if r == rank) for rank in range(3)]
    even = designate(shapes, 3)
    was = [sum(ns_cost(shapes[t]) for t, r in even.items() if r == rank) for rank in range(3)]
    assert load[1] < was[1] and load[1] < min(load[0], load[2]), (load, was)
    for bad in ([1.0, 0.0, 1.0], [1.0, float("nan"), 1.0], [1.0, 1.0], [1.0, True, 1.0]):
        with pytest.raises(ConfigError, match=r"speeds"):
            designate(shapes, 3, bad)


def test_speeds_move_the_work_and_not_the_bits() -> None:
    want = reference("muon+adamw")
    speeds = [1.0, 0.05, 1.0]

    def member(rank: int, gather: Any) -> tuple[str, str, dict[int, int]]:
        params = muon_params()
        group = BUILDS["muon+adamw"](params)
        own = Ownership.balanced(_sizes(), 3)
        zero = ZeroOptimizer(params, group, own, gather, timeout=TIMEOUT)
        for step in range(STEPS):
            zero.set_speeds(speeds if step else None)  # as a replan after the first step
            muon_grads(params, step)
            zero.step()
        return params_sha(params), state_sha(zero.full_state_dict()), zero.designated

    got = on_threads(3, member)
    assert {(p, s) for p, s, _ in got} == {want}
    (designated,) = {tuple(sorted(d.items())) for _, _, d in got}  # the same on every rank
    shapes = {t: SHAPES[t] for t in MATRICES}
    assert dict(designated) == designate(shapes, 3, speeds)
    load = [sum(ns_cost(shapes[t]) for t, r in designated if r == rank) for rank in range(3)]
    even = designate(shapes, 3)
    assert load[1] < sum(ns_cost(shapes[t]) for t, r in even.items() if r == 1)
    assert load[1] < min(load[0], load[2]), load  # the slow rank: the least work


def test_every_matrix_is_orthogonalised_once_in_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not once per member: the rank designated for a matrix steps it whole, and the
    parameter gather sends it from there."""
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = zero_matrices.step_matrix

    def counted(param: torch.Tensor, update: torch.Tensor, group: Any) -> None:
        calls.append((threading.get_ident(), tuple(param.shape)))
        real(param, update, group)

    monkeypatch.setattr(zero_matrices, "step_matrix", counted)
    world = 4
    assert _sharded("muon", chunked(world, 97)) == {reference("muon")}
    # matrix 2 has no gradient at step 0: torch's Muon, and so no rank, steps it then
    want = sorted([SHAPES[i] for i in MATRICES] * STEPS)
    want.remove(SHAPES[2])
    assert sorted(s for _, s in calls) == want
    assert len({thread for thread, _ in calls}) == world  # four matrices on four ranks


def test_zero2_gradients_must_say_which_tensors_have_one() -> None:
    def member(rank: int, gather: Any) -> None:
        params = muon_params()
        zero = ZeroOptimizer(params, _muon(params), Ownership.balanced(_sizes(), 2), gather)
        with pytest.raises(ConfigError, match="attach_grads needs given="):
            zero.attach_grads([None] * len(zero.windows))

    on_threads(2, member)


def test_the_all_to_all_delivers_each_buffer_to_its_rank_and_bounds_them() -> None:
    """The seam Muon's pieces travel by (zero/gather.py ``alltoall``), on the thread fake;
    the gloo and communicator ones run in test_zero.py's workers and the job tests."""

    def member(rank: int, gather: Any) -> list[list[int]]:
        sends = [torch.full((rank + d,), 10 * rank + d, dtype=torch.uint8) for d in range(3)]
        return [t.tolist() for t in gather.alltoall(sends, 4, TIMEOUT)]

    for rank, got in enumerate(on_threads(3, member)):
        assert got == [[10 * r + rank] * (r + rank) for r in range(3)]

    def too_long(rank: int, gather: Any) -> None:
        sends = [torch.zeros(5 if rank == 1 else 1, dtype=torch.uint8) for _ in range(2)]
        with pytest.raises(BadMessage, match="rank 1 sent 5 bytes; at most 4 expected"):
            gather.alltoall(sends, 4, TIMEOUT)

    on_threads(2, too_long)
    with pytest.raises(ConfigError, match="one buffer per rank: 1 for 2"):
        LocalGathers(2).rank(0).alltoall([torch.zeros(1, dtype=torch.uint8)], 4, TIMEOUT)
