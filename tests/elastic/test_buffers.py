"""Buffers the forward changes (BatchNorm's running statistics and batch counter) end with
the same bits on every member and at every world size (keepstep.elastic.buffers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from keepstep.elastic.buffers import BufferSync, synced_buffers
from keepstep.launch.local import LocalRun, agreed_sha, run_local

N_MICRO = 4
JOB = str(Path(__file__).resolve().parent / "batchnorm_job.py")


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(4, 6, generator=g) * (1 + i) for i in range(N_MICRO)]


def member_step(model: nn.Module, sync: BufferSync, ids: list[int]) -> list[float]:
    """This member's share of one step: a training forward per micro-batch."""
    data = batches()
    sync.begin_step()
    for mb in ids:
        model(data[mb])
        sync.end_micro_batch(mb)
    return sync.flags()


def step_of(members: list[list[int]]) -> nn.Sequential:
    """One step of members computing these micro-batches; the buffers of the first member
    (the test checks they are every member's)."""
    models = [bn_model() for _ in members]
    syncs = [BufferSync(m, N_MICRO) for m in models]
    flags = [member_step(m, s, ids) for m, s, ids in zip(models, syncs, members, strict=True)]
    changed = [sum(column) > 0 for column in zip(*flags, strict=True)]  # the caller slots' sum
    summed = sum(s.gather(changed, torch.device("cpu")) for s in syncs)
    assert isinstance(summed, torch.Tensor)
    for s in syncs:
        s.apply(summed, changed)
    first = models[0][1].state_dict()
    for other in models[1:]:
        for name, value in other[1].state_dict().items():
            assert torch.equal(value, first[name]), name
    return models[0]


def test_every_world_size_ends_with_the_mean_of_what_each_micro_batch_left() -> None:
    alone = step_of([[0, 1, 2, 3]])
    pair = step_of([[0, 2], [3, 1]])  # computed in any order
    three = step_of([[1], [0, 3], [2]])
    for model in (pair, three):
        for name, value in model.state_dict().items():
            assert torch.equal(value, alone.state_dict()[name]), name
    # The rule: each micro-batch from the step's values, then their mean in micro-batch order.
    fresh, data = bn_model(), batches()
    start = {k: v.clone() for k, v in fresh[1].state_dict().items()}
    left = []
    for x in data:
        fresh[1].load_state_dict(start)
        fresh(x)
        left.append(fresh[1].running_mean.to(torch.float64))
    mean = left[0].clone()
    for value in left[1:]:
        mean += value
    assert torch.equal(alone[1].running_mean, (mean / N_MICRO).to(torch.float32))
    assert not torch.equal(alone[1].running_mean, start["running_mean"])
    assert int(alone[1].num_batches_tracked) == 1  # advanced once per step, not per micro-batch


def test_buffers_nothing_changed_are_not_gathered() -> None:
    model = bn_model().eval()  # eval: BatchNorm reads its statistics and writes none
    sync = BufferSync(model, N_MICRO)
    flags = member_step(model, sync, [0, 1, 2, 3])
    assert flags == [0.0] * sync.count == [0.0, 0.0, 0.0]
    changed = [False] * sync.count
    assert sync.gather(changed, torch.device("cpu")).numel() == 0


def test_only_buffers_a_snapshot_holds_are_kept_in_step() -> None:
    model = bn_model()
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    kept = [attr for _, attr in synced_buffers(model)]
    assert kept == ["running_mean", "running_var", "num_batches_tracked"]
    with pytest.raises(ValueError, match="2 flags for 3 buffers"):
        BufferSync(model, N_MICRO).gather([True, False], torch.device("cpu"))


@pytest.mark.slow
def test_a_batchnorm_job_ends_identical_alone_sharded_and_through_a_crash(
    tmp_path: Path,
) -> None:
    def launch(name: str, schedule: list[list[str]], env: dict[str, str], **kw: object) -> str:
        run = LocalRun(
            script=JOB, steps=8, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        result = run_local(run, tmp_path / name, {**os.environ, **env})
        for member, code in result.returncodes.items():
            assert code == 0, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
            assert "batches_tracked=8 " in result.logs[member], result.logs[member][-500:]
        return agreed_sha(result)

    alone = launch("alone", [["m0"]], {})
    three = [["m0", "m1", "m2"], ["m0", "m2"], ["m0", "m1", "m2"]]
    crash = launch(
        "crash", three, {}, at_step=[0, None, 5], crash={"m1": 3}, restart={"m1": 2},
        timeout_scale=4.0,
    )  # fmt: skip
    zero2 = launch("zero2", [["m0", "m1", "m2"]], {"KEEPSTEP_SHARD": "zero2"})
    assert crash == alone and zero2 == alone
