"""Members step with the same optimizer hyperparameters (hyper.py): the hash each member
adds, what it tells apart, and a plateau scheduler stepped with a member's own loss
refused on every member, while the same scheduler stepped with the step's shared loss
keeps the one-member run's bits."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from keepstep.elastic import ConfigError, HyperparametersDiffer
from keepstep.elastic.hyper import HyperCheck, fingerprint, hash_bits
from keepstep.launch.local import LocalRun, agreed_sha, run_local

JOB = str(Path(__file__).resolve().parent / "plateau_job.py")


def _optimizer(**overrides: object) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    for key, value in overrides.items():
        optimizer.param_groups[1][key] = value
    return optimizer


def test_the_hash_follows_every_hyperparameter_and_nothing_else() -> None:
    base = fingerprint(_optimizer().param_groups[1])
    assert fingerprint(_optimizer().param_groups[1]) == base  # other params, same values
    for change in [
        {"lr": 0.25},
        {"lr": torch.tensor(0.5, dtype=torch.float64)},  # a tensor lr is not a float lr
        {"betas": (0.9, 0.95)},
        {"weight_decay": -0.0},
        {"amsgrad": True},
        {"initial_lr": 0.5},  # a key a scheduler adds
    ]:
        assert fingerprint(_optimizer(**change).param_groups[1]) != base, change
    assert fingerprint(_optimizer(lr=torch.tensor(0.25)).param_groups[1]) == fingerprint(
        _optimizer(lr=torch.tensor(0.25)).param_groups[1]
    )
    # an object's type counts, not its address (which differs in every process)
    one, two = (
        fingerprint(_optimizer(fn=lambda: 1).param_groups[1]),
        fingerprint(_optimizer(fn=lambda: 2).param_groups[1]),
    )
    assert one == two != base


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [1, 2, 3, 100, 2**20])
def test_the_hash_has_as_many_bits_as_the_sums_hold_exactly(dtype: torch.dtype, world: int) -> None:
    bits = hash_bits(world, dtype)
    significand = {torch.float32: 24, torch.float64: 53}[dtype]
    assert 1 <= bits <= 16 and world * (2**bits - 1) ** 2 < 2**significand
    assert bits == 16 or world * (2 ** (bits + 1) - 1) ** 2 >= 2**significand // 2
    h = 2**bits - 1  # the largest: its square summed over the world stays exact
    summed = torch.full((world,), float(h * h), dtype=dtype).sum() if world < 1000 else None
    if summed is not None:
        assert int(summed) == world * h * h


def _summed(optimizers: list[torch.optim.Optimizer], dtype: torch.dtype) -> list[float]:
    """What the gradient buffer's sum hands every member: each member's slots, added."""
    world = len(optimizers)
    total = torch.zeros(HyperCheck(optimizers[0]).count, dtype=dtype)
    for optimizer in optimizers:
        slots = torch.full_like(total, math.nan)
        HyperCheck(optimizer).fill(slots, world)
        total += slots
    return total.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_members_that_agree_pass_and_every_member_names_the_group_that_differs(
    dtype: torch.dtype,
) -> None:
    same = [_optimizer() for _ in range(3)]
    for optimizer in same:
        HyperCheck(optimizer).check(_summed(same, dtype), 3, step=4)
    apart = [_optimizer(), _optimizer(lr=0.25), _optimizer()]
    summed = _summed(apart, dtype)
    for optimizer, lr in zip(apart, [0.5, 0.25, 0.5], strict=True):  # every member: same sums
        with pytest.raises(HyperparametersDiffer) as error:
            HyperCheck(optimizer).check(summed, 3, step=4)
        text = str(error.value)
        assert "step 4: the 3 members would step with different" in text
        assert "in param group 1 (this member's group 1: amsgrad=False, betas=(0.9, " in text
        assert f"lr={lr}" in text and "group 0" not in text
        assert "ReduceLROnPlateau.step(result.metrics['loss'])" in text
    assert issubclass(HyperparametersDiffer, ConfigError)


def test_a_param_group_added_after_init_is_refused_by_name() -> None:
    optimizer = _optimizer()
    check = HyperCheck(optimizer)
    optimizer.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(ConfigError, match=r"3 param groups, 2 when keepstep\.init ran"):
        check.fill(torch.zeros(check.count, dtype=torch.float64), 2)


@pytest.mark.slow
def test_a_plateau_scheduler_stepped_with_a_members_own_loss_is_refused_on_every_member(
    tmp_path: Path,
) -> None:
    def launch(name: str, metric: str, schedule: list[list[str]], **kw: object) -> LocalRun:
        return LocalRun(
            script=JOB, steps=10, global_batch=32, micro_batch=4, schedule=schedule, seed=2,
            script_args=["--metric", metric], timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    # The step's loss is the same on every member: alone, in three and through a crash
    # the plateau cuts the lr at the same steps, and the parameters end identical.
    alone = run_local(launch("alone", "shared", [["m0"]]), tmp_path / "alone", os.environ)
    three = [["m0", "m1", "m2"], ["m0", "m2"], ["m0", "m1", "m2"]]
    crash = run_local(
        launch("crash", "shared", three, at_step=[0, None, 6], crash={"m1": 3},
               restart={"m1": 2}, timeout_scale=4.0),
        tmp_path / "crash",
        os.environ,
    )  # fmt: skip
    assert agreed_sha(crash) == agreed_sha(alone)
    lrs = re.findall(r"lrs=\[(.*)\]", alone.logs["m0"])[-1].split(", ")
    assert len(lrs) == 10 and float(lrs[-1]) < 0.2, lrs  # the plateau did cut the lr
    assert all(re.findall(r"lrs=\[(.*)\]", log)[-1] for log in crash.logs.values())
    # Each member's own loss: alone it is the step's and trains; in two the schedulers part,
    # and both members stop at the same step, before any parameter is stepped apart.
    own = run_local(launch("own", "own", [["m0", "m1"]]), tmp_path / "own", os.environ)
    # ZeRO-2 reduce-scatters the gradient; the caller slots still reach every member.
    zero2 = run_local(
        launch("zero2", "own", [["m0", "m1"]]),
        tmp_path / "zero2",
        {**os.environ, "KEEPSTEP_SHARD": "zero2"},
    )
    steps = set()
    for member, result in [(m, run) for run in (own, zero2) for m in ("m0", "m1")]:
        assert result.returncodes[member] != 0, result.logs[member][-2000:]
        found = re.findall(
            r"HyperparametersDiffer: step (\d+): the 2 members would step", result.logs[member]
        )
        assert found, result.logs[member][-2000:]
        steps.add(found[-1])
    assert len(steps) == 1 and int(steps.pop()) > 0  # the same step, sharded or not
