"""ZeRO-1 inside the job (sharded.py): ``keepstep.init(..., shard="zero1")`` in one process,
the gather adapter over the communicator's ``allgather_bytes`` with ranks on threads, and
the epoch's ownership. The multi-process runs are in test_shard_zero_job.py."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, JobConfig
from keepstep.elastic.config import Shard
from keepstep.elastic.errors import BadMessage, KeepstepError, PeerLost
from keepstep.elastic.shard.layout import pieces_of
from keepstep.elastic.shard_epoch import ownership_for
from keepstep.elastic.sharded import CommGather, ShardedOptimizer, optimizer_sha256
from keepstep.elastic.sharded_checkpoint import holds_pieces_named
from keepstep.elastic.zero import ALIGN, ZeroOptimizer

_TIMEOUT = timedelta(seconds=20)


def make() -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 6, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Dropout(0.1), nn.Linear(40, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def train(steps: int, **kw: object) -> tuple[keepstep.Job, str, str]:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, **kw)  # type: ignore[arg-type]
    for step in job.steps(steps):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        assert step.commit()
    return job, job.params_sha256(), job.optimizer_sha256()


# ---- configuration -------------------------------------------------------------------


def test_shard_names_what_is_allowed() -> None:
    assert JobConfig(global_batch=8, micro_batch=4).shard is None
    assert JobConfig(global_batch=8, micro_batch=4, shard="zero1").shard is Shard.ZERO1  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"shard='zero3' is not one of: 'zero1', 'zero2' \(or"):
        JobConfig(global_batch=8, micro_batch=4, shard="zero3")  # type: ignore[arg-type]


def test_shard_from_the_launcher_and_the_script_must_agree() -> None:
    model, opt, data = make()
    job = keepstep.init(
        model, opt, data, global_batch=32, micro_batch=4, env={"KEEPSTEP_SHARD": "zero1"}
    )
    assert job.config.shard is Shard.ZERO1 and job.sharded is not None
    model, opt, data = make()
    plain = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, env={})
    assert plain.config.shard is None and plain.sharded is None
    with pytest.raises(ConfigError, match=r"shard='zero1'.*KEEPSTEP_SHARD=bogus"):
        keepstep.init(model, opt, data, 32, 4, shard="zero1", env={"KEEPSTEP_SHARD": "bogus"})
    with pytest.raises(ConfigError, match="shard='bogus' is not one of"):
        keepstep.init(model, opt, data, 32, 4, env={"KEEPSTEP_SHARD": "bogus"})


def test_an_optimizer_that_is_not_elementwise_is_refused_at_init() -> None:
    model, _, data = make()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ConfigError, match="ZeRO-1 cannot shard LBFGS"):
        keepstep.init(model, lbfgs, data, 32, 4, shard="zero1", env={})


def test_parameters_on_two_devices_are_refused_and_one_device_is_taken() -> None:
    # "meta" stands in for a GPU: any device but the CPU.
    mixed = [torch.nn.Parameter(torch.zeros(4, 3, device=d)) for d in ("cpu", "meta")]
    with pytest.raises(ConfigError, match=r"one device; these are on cpu, meta: .*device\(\)"):
        ShardedOptimizer(mixed, torch.optim.Adam(mixed))
    params = [torch.nn.Parameter(torch.zeros(4, 3, device="meta"))]
    assert ShardedOptimizer(params, torch.optim.Adam(params)).zero is None


def test_a_grad_scaler_with_shard_is_taken() -> None:
    # Its numbers against full replicas: test_mixed_precision.py.
    model, opt, data = make()
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    job = keepstep.init(model, opt, data, 32, 4, shard="zero1", grad_scaler=scaler, env={})
    assert job.sharded is not None and job.grad_scaler is scaler


# ---- the job -------------------------------------------------------------------------


def test_one_member_zero1_matches_full_replicas() -> None:
    sharded, params, optim = train(12, shard="zero1", env={})
    _, params_full, optim_full = train(12, env={})
    assert (params, optim) == (params_full, optim_full)
    # Entering the epoch cut the shards (timed as its own part of the restore); one member
    # steps every element.
    (entered,) = sharded.reconfigurations
    assert 0 < entered.reshard_s <= entered.restore_s
    assert entered.stepped_elements == sum(p.numel() for p in sharded.params)
    # The state lives in the shards, and the snapshot of the last step holds it whole.
    assert not sharded.optimizer.state
    assert sharded.sharded is not None and sharded.sharded.zero is not None
    assert sharded.sharded.zero.state_bytes() > 0
    # The snapshot holds this member's pieces (all of them, alone), not torch's format.
    last = sharded.snapshots.load(12)
    assert holds_pieces_named(last.tensors)
    assert not any(name.endswith("/exp_avg_sq") for name in last.tensors)
    # Between steps the exchanged pieces are gone (the snapshot took them); a second
    # snapshot of the same commit would have none to take, and says so.
    with pytest.raises(KeepstepError, match="needs the pieces its commit exchanged"):
        sharded.sharded.for_snapshot({})


def _train_clipped(steps: int, **kw: object) -> tuple[str, str]:
    model, opt, data = make()
    job = keepstep.init(
        model,
        opt,
        data,
        32,
        4,
        seed=1,
        clip_grad_norm=0.05,
        env={},
        **kw,  # type: ignore[arg-type]
    )
    sched = job.track("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    for step in job.steps(steps):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        if step.commit():
            sched.step()
    return job.params_sha256(), job.optimizer_sha256()


def test_zero1_follows_clipping_and_an_lr_schedule_like_the_full_optimizer() -> None:
    sharded = _train_clipped(7, shard="zero1")
    assert sharded == _train_clipped(7)
    assert sharded != _train_clipped(6, shard="zero1")  # the figures do see one more step


def test_optimizer_sha256_sees_every_value() -> None:
    _, _, before = train(3, env={})
    model, opt, data = make()
    job = keepstep.init(model, opt, data, 32, 4, seed=1, env={})
    for step in job.steps(3):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    state = opt.state_dict()
    assert optimizer_sha256(state) == before
    state["state"][0]["exp_avg"][0, 0] += 1e-7
    assert optimizer_sha256(state) != before


# ---- the gather over allgather ---------------------------------------------------------


class _BytesHub:
    """Ranks on threads exchanging tensors, as Communicator.allgather does."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor] = [torch.empty(0)] * world
        self.barrier = threading.Barrier(world)

    def rank(self, rank: int) -> _BytesMember:
        return _BytesMember(self, rank)


class _BytesMember:
    device = torch.device("cpu")

    def __init__(self, hub: _BytesHub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.world

    def allgather(
        self,
        tensor: torch.Tensor,
        timeout: timedelta | None = None,
        into: Callable[[int], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        wait = None if timeout is None else timeout.total_seconds()
        try:
            self.hub.slots[self.rank] = tensor.clone()
            self.hub.barrier.wait(wait)
            out = list(self.hub.slots)
            self.hub.barrier.wait(wait)
        except threading.BrokenBarrierError:
            raise PeerLost(0, f"rank {self.rank}: a peer did not arrive") from None
        if into is None:
            return out
        # As the Communicator does: into one buffer the caller keeps, views of it returned.
        kept = into(sum(t.numel() for t in out)).view(-1, tensor.numel())
        for slot, t in zip(kept, out, strict=True):
            slot.copy_(t)
        return list(kept)


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(2)
    shapes: list[tuple[int, ...]] = [(37, 5), (300,), (1,), (700, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def test_zero1_over_the_communicators_allgather_matches_the_full_step() -> None:
    world, steps = 3, 3
    ref = _params()
    ref_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.01)
    for s in range(steps):
        for p, grad in zip(ref, _grads(s, ref), strict=True):
            p.grad = grad
        ref_opt.step()
    hub = _BytesHub(world)
    found: dict[int, tuple[list[torch.Tensor], str]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            params = _params()
            opt = torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
            ownership = ownership_for([p.numel() for p in params], ["a", "b", "c"])
            zero = ZeroOptimizer(params, opt, ownership, CommGather(hub.rank(r)), timeout=_TIMEOUT)
            for s in range(steps):
                for p, grad in zip(params, _grads(s, params), strict=True):
                    p.grad = grad
                zero.step()
            found[r] = (
                [p.detach().clone() for p in params],
                optimizer_sha256(zero.full_state_dict()),
            )
        except BaseException as err:  # reported below, with the rank's own traceback
            errors.append(err)
            hub.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want = optimizer_sha256(ref_opt.state_dict())
    for r in range(world):
        params, sha = found[r]
        assert sha == want
        assert all(torch.equal(a, b.detach()) for a, b in zip(params, ref, strict=True))


def test_comm_gather_keeps_shape_and_dtype_and_refuses_a_short_slot() -> None:
    class Short:
        rank, size, device = 0, 2, torch.device("cpu")

        def allgather(
            self,
            tensor: torch.Tensor,
            timeout: timedelta | None = None,
            into: Callable[[int], torch.Tensor] | None = None,
        ) -> list[torch.Tensor]:
            return [tensor, tensor[:-1]]

    class Echo(Short):
        def allgather(
            self,
            tensor: torch.Tensor,
            timeout: timedelta | None = None,
            into: Callable[[int], torch.Tensor] | None = None,
        ) -> list[torch.Tensor]:
            return [tensor.clone(), tensor.clone()]

    mine = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    out = CommGather(Echo()).allgather(mine, _TIMEOUT)
    assert [o.dtype for o in out] == [torch.int64] * 2 and all(torch.equal(o, mine) for o in out)
    with pytest.raises(BadMessage, match="rank 1 sent 47 uint8 values, 48 bytes expected"):
        CommGather(Short()).allgather(mine, _TIMEOUT)


# ---- the epoch's ownership -------------------------------------------------------------


def test_ownership_is_chunked_balanced_and_keeps_survivors_chunks() -> None:
    sizes = [100_000, 3, 200_000, 77]
    members = sorted(f"n{n}/{i}" for n in range(4) for i in range(2))
    own = ownership_for(sizes, members)
    counts = [own.owned(r) for r in range(len(members))]
    assert sum(counts) == sum(sizes)
    assert max(counts) <= 1.15 * sum(sizes) / len(members)  # within the layout's bound
    offsets = [0, *itertools.accumulate(sizes)]
    for rs in own.ranges:  # every piece starts on a window boundary of its tensor
        assert all(a % ALIGN == 0 for r in rs for _t, a, _b in pieces_of(offsets, *r))
    # A node lost: the survivors keep (nearly) all they owned; the rest is the lost share.
    survivors = [m for m in members if not m.startswith("n2/")]
    after = ownership_for(sizes, survivors)
    kept = 0
    for m in survivors:
        before = {x for r in own.ranges[members.index(m)] for x in range(r.start, r.stop)}
        now = {x for r in after.ranges[survivors.index(m)] for x in range(r.start, r.stop)}
        kept += len(before & now)
    lost = sum(counts[members.index(m)] for m in members if m not in survivors)
    assert kept >= sum(sizes) - lost - 0.1 * lost
    plain = ownership_for(sizes, ["m0", "m1", "m2"])  # local names: a node each
    assert sum(plain.owned(r) for r in range(3)) == sum(sizes)
