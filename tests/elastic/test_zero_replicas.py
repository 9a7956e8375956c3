"""ZeRO-1's replicas stepped where they are kept (zero/replicas.py) get the owners' bits.

The owner's bits are the unsharded step's (the ZeRO-1 tests show that): so a
``ReplicaSteps`` over a member's replica pieces, stepped on the same parameters and
gradients as a full optimizer, must hold exactly the full optimizer's state for those
elements after every step, and must leave the parameters alone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from keepstep.elastic.shard_epoch import epoch_shards
from keepstep.elastic.snapshot_shard import cut_state
from keepstep.elastic.zero import ELEMENTWISE
from keepstep.elastic.zero.replicas import ReplicaSteps
from shard_states import trained_adam

Setup = tuple[list[torch.nn.Parameter], torch.optim.Optimizer]


def adamw_one_step() -> Setup:
    """Odd sizes around the alignment, weight decay, one step in: replicas are taken
    from the epoch's first commit, after a step."""
    g = torch.Generator().manual_seed(3)
    shapes: list[tuple[int, ...]] = [(129,), (0,), (513, 3), (7,), (4000,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return params, opt


@pytest.mark.parametrize("setup", [trained_adam, adamw_one_step], ids=["adam-amsgrad", "adamw"])
@pytest.mark.parametrize("member", ["n0/0", "n1/0", "n2/0"])
def test_replicas_stepped_here_hold_the_full_steps_bits(
    setup: Callable[[], Setup], member: str
) -> None:
    params, full = setup()
    keys = ELEMENTWISE[type(full)]
    sizes = [p.numel() for p in params]
    members = ["n0/0", "n1/0", "n2/0"]
    shards = epoch_shards(sizes, members)
    replicas = [r for r in shards.held[member] if r not in shards.owned[member]]
    kept = cut_state(full.state_dict(), sizes, keys, replicas)
    assert kept, "the member keeps replicas"
    steps = ReplicaSteps(full, kept, keys)
    g = torch.Generator().manual_seed(11)
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        full.param_groups[0]["lr"] *= 0.9  # a schedule: the replicas follow the front's groups
        before = [p.detach().clone() for p in params]
        steps.step()
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        full.step()
        want = cut_state(full.state_dict(), sizes, keys, replicas)
        got = steps.pieces()
        assert got.keys() == want.keys(), step
        for key, state in want.items():
            assert got[key].keys() == state.keys()
            for name, value in state.items():
                mine = got[key][name]
                assert mine.dtype == value.dtype and torch.equal(mine, value), (step, key, name)
    assert steps.state_bytes() >= sum(
        v.numel() * v.element_size() for s in want.values() for v in s.values()
    )
