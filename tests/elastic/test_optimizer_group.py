"""Several optimizers as one (optimizer_group.py): the group's view of its members, its
state dict, grad scaling, the LR warning, and a job of Muon and AdamW at any world size."""

from __future__ import annotations

import copy
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, OptimizerGroup, ScriptStateWarning
from keepstep.elastic.lr_watch import LrWatch
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.train_state import capture, restore
from keepstep.elastic.zero.optimizers import check_supported
from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

JOB = str(Path(__file__).resolve().parent / "optimizer_group_job.py")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def muon_adamw(model: nn.Sequential) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :2]).backward()  # type: ignore[no-untyped-call]
        opt.step()


def flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": v for k, v in per_param.items() if torch.is_tensor(v)})
    return out


def test_the_group_shows_its_members_groups_and_state_as_one() -> None:
    model = mlp()
    muon, adamw = muon_adamw(model)
    group = OptimizerGroup([muon, adamw])
    assert group.param_groups == muon.param_groups + adamw.param_groups
    group.param_groups[1]["lr"] = 0.5  # the same dicts: the member sees it
    assert adamw.param_groups[0]["lr"] == 0.5
    assert group.owner_of(0) is muon and group.owner_of(1) is adamw
    with pytest.raises(IndexError, match="param group 2: the group has 2"):
        group.owner_of(2)
    assert len(group.state) == 0
    train(model, group, 1)
    assert len(group.state) == len(list(model.parameters()))  # both members stepped
    weight, bias = model[0].weight, model[0].bias
    assert weight in group.state and set(group.state[weight]) == {"momentum_buffer"}
    assert group.state[bias] is adamw.state[bias]
    group.state[bias] = {"step": torch.tensor(7.0)}
    assert float(adamw.state[bias]["step"]) == 7.0
    del group.state[bias]
    assert bias not in adamw.state and bias not in group.state
    with pytest.raises(KeyError, match="belongs to no optimizer of the group"):
        group.state[torch.zeros(1)]
    group.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert repr(group) == "OptimizerGroup(Muon, AdamW)"


def test_its_state_dict_is_one_optimizers_over_the_same_groups_and_loads_back() -> None:
    one, two = mlp(), mlp()
    parts = [list(one[0].parameters()), list(one[2].parameters())]
    single = torch.optim.AdamW([{"params": ps} for ps in parts], lr=1e-2)
    group = OptimizerGroup([torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (two[0], two[2])])
    train(one, single, 3)
    train(two, group, 3)
    packed, ours = single.state_dict(), group.state_dict()
    assert ours["param_groups"] == packed["param_groups"]
    assert ours["state"].keys() == packed["state"].keys()
    for i, per_param in packed["state"].items():
        for key, value in per_param.items():
            assert torch.equal(ours["state"][i][key], value), (i, key)
    # a fresh group loads it and trains on as the original does
    fresh = mlp(5)
    fresh.load_state_dict(two.state_dict())
    reloaded = OptimizerGroup(
        [torch.optim.AdamW(m.parameters(), lr=1.0) for m in (fresh[0], fresh[2])]
    )
    reloaded.load_state_dict(copy.deepcopy(ours))  # torch keeps the tensors it is given
    assert reloaded.param_groups[0]["lr"] == 1e-2
    train(two, group, 2, seed=4)
    train(fresh, reloaded, 2, seed=4)
    for key, value in flat(two, group).items():
        assert torch.equal(flat(fresh, reloaded)[key], value), key
    with pytest.raises(ConfigError, match=r"sizes \[2\]; this group's optimizers have \[2, 2\]"):
        reloaded.load_state_dict({"state": {}, "param_groups": packed["param_groups"][:1]})


def test_a_snapshot_of_a_group_restores_every_members_state_in_place() -> None:
    model = mlp()
    group = OptimizerGroup(list(muon_adamw(model)))
    train(model, group, 2)
    store = SnapshotStore(MemoryBuffer(), background=False)
    state = capture(2, model, group)
    store.commit(2, state.tensors, state.meta)
    at_2 = {k: v.clone() for k, v in flat(model, group).items()}
    other = mlp(9)
    other_group = OptimizerGroup(list(muon_adamw(other)))
    restore(store.load(2), other, other_group)
    assert flat(other, other_group).keys() == at_2.keys()
    for key, value in flat(other, other_group).items():
        assert torch.equal(value, at_2[key]), key
    train(model, group, 2, seed=3)
    train(other, other_group, 2, seed=3)
    for key, value in flat(other, other_group).items():
        assert torch.equal(value, flat(model, group)[key]), key


def test_a_grad_scaler_unscales_and_skips_every_member() -> None:
    model = mlp()
    muon, adamw = muon_adamw(model)
    group = OptimizerGroup([muon, adamw])
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x = torch.randn(8, 4)
    scaler.scale(F.mse_loss(model(x), x[:, :2])).backward()  # type: ignore[no-untyped-call]
    scaled = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    scaler.unscale_(group)
    for before, p in zip(scaled, model.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, before / 4.0)
    scaler.step(group)  # finite: both members step
    scaler.update()
    assert set(muon.state) and set(adamw.state) and scaler.get_scale() == 4.0
    group.zero_grad()
    scaler.scale(F.mse_loss(model(x), x[:, :2])).backward()  # type: ignore[no-untyped-call]
    model[2].bias.grad[0] = float("inf")  # type: ignore[index]  # in the second member
    weights = [p.clone() for p in model.parameters()]
    scaler.step(group)  # neither member steps
    scaler.update()
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0


def test_an_lr_moved_in_a_member_warns_unless_that_members_scheduler_is_tracked() -> None:
    model = mlp()
    muon, adamw = muon_adamw(model)
    group = OptimizerGroup([muon, adamw])
    muon_sched = torch.optim.lr_scheduler.StepLR(muon, step_size=1, gamma=0.5)
    adamw_sched = torch.optim.lr_scheduler.StepLR(adamw, step_size=1, gamma=0.5)
    train(model, group, 1)  # the optimizers step before their schedulers do
    watch = LrWatch(group)
    watch.reset()
    muon_sched.step()  # owned by a tracked scheduler: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check(1, [muon_sched])
    adamw_sched.step()  # only muon's is tracked: adamw's lr moved with nothing to move it back
    with pytest.warns(ScriptStateWarning, match="param group 1 changed from 0.01 to 0.005"):
        watch.check(2, [muon_sched])


def test_bad_groups_are_refused_by_name() -> None:
    model = mlp()
    shared = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"in optimizer\[0\] \(SGD\) and optimizer\[1\] \(Adam\)"):
        OptimizerGroup([shared, torch.optim.Adam(model[2].parameters())])
    with pytest.raises(ConfigError, match="at least one"):
        OptimizerGroup([])
    with pytest.raises(ConfigError, match=r"optimizer\[1\] is a str"):
        OptimizerGroup([shared, "adam"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match=r"optimizer\[0\] is itself an OptimizerGroup"):
        OptimizerGroup([OptimizerGroup([shared])])
    group = OptimizerGroup([shared])
    with pytest.raises(ConfigError, match="without a closure"):
        group.step(lambda: 0.0)
    with pytest.raises(ConfigError, match="add a param group to one of"):
        group.add_param_group({"params": []})
    assert check_supported(group) == {"momentum_buffer"}  # ZeRO shards member by member
    lbfgs = OptimizerGroup(
        [torch.optim.SGD(model[0].parameters()), torch.optim.LBFGS(model[2].parameters())]
    )
    with pytest.raises(ConfigError, match="cannot shard LBFGS: it re-evaluates a closure"):
        check_supported(lbfgs)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    with pytest.raises(ConfigError, match="optimizer=<function"):
        keepstep.init(model, mlp, data, global_batch=8, micro_batch=4, env={})  # type: ignore[arg-type]


def _job(group: bool) -> str:
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 2, generator=g))
    model = mlp(3)
    parts = [list(model[0].parameters()), list(model[2].parameters())]
    if group:
        optimizer: object = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in parts]
    else:
        optimizer = torch.optim.SGD([{"params": ps} for ps in parts], lr=0.1, momentum=0.9)
    job = keepstep.init(
        model, optimizer, data, global_batch=16, micro_batch=4, seed=1, env={},  # type: ignore[arg-type]
        clip_grad_norm=0.5,
    )  # fmt: skip
    for step in job.steps(6):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        assert step.commit()
    return job.params_sha256()


def test_a_job_of_two_optimizers_trains_as_one_optimizer_with_their_groups() -> None:
    assert _job(group=True) == _job(group=False)


@pytest.mark.slow
def test_a_muon_and_adamw_job_ends_identical_alone_and_through_a_crash(tmp_path: Path) -> None:
    """Unsharded, and sharded with ZeRO-1 (replicas stepped where they are kept) and
    ZeRO-2: the same parameters and the same gathered optimizer state as one member."""

    def launch(name: str, schedule: list[list[str]], shard: str = "", **kw: object) -> set[str]:
        run = LocalRun(
            script=JOB, steps=8, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KEEPSTEP_SHARD"}
        result = run_local(
            run, tmp_path / name, {**env, **({"KEEPSTEP_SHARD": shard} if shard else {})}
        )
        ends = set()
        for member, code in result.returncodes.items():
            log = result.logs[member]
            assert code == 0, f"{member} exited {code}:\n{log[-3000:]}"
            moments = "muon_moments=0 " if shard else "muon_moments=2048 "
            assert moments in log, log[-500:]
            assert "ScriptStateWarning" not in log  # both schedulers tracked
            ends |= set(re.findall(r"optim_sha256=(\w+) params_sha256=(\w+)", log)[-1:])
        assert len(ends) == 1, ends
        return {agreed_sha(result), *next(iter(ends))}

    alone = launch("alone", [["m0"]])
    three = [["m0", "m1", "m2"], ["m0", "m2"], ["m0", "m1", "m2"]]
    crash = {"at_step": [0, None, 5], "crash": {"m1": 3}, "restart": {"m1": 2}}
    for shard in ("", "zero1", "zero2"):
        got = launch(f"crash-{shard}", three, shard, timeout_scale=4.0, **crash)
        assert got == alone, shard or "unsharded"


@pytest.mark.slow
def test_a_member_lost_inside_muons_all_to_all_fails_the_step_not_the_numbers(
    tmp_path: Path,
) -> None:
    """m1 dies as ZeRO-1's Muon sends its momentum pieces at step 4 (the others have moved
    their momentum and wait in the all-to-all): they get PeerLost there, do not commit
    step 4, restore its snapshot and repeat it with two members, to one member's bits."""

    def launch(name: str, schedule: list[list[str]], *args: str, **kw: object) -> LocalResult:
        run = LocalRun(
            script=JOB, steps=8, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, script_args=args, timeout_scale=4.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KEEPSTEP_SHARD"}
        return run_local(run, tmp_path / name, {**env, "KEEPSTEP_SHARD": "zero1"})

    alone = agreed_sha(launch("alone", [["m0"]]))
    schedule = [["m0", "m1", "m2"], ["m0", "m2"]]
    result = launch("lost", schedule, "--die-in-alltoall", "m1:4", at_step=[0, None])
    assert result.returncodes == {"m0": 0, "m1": -9, "m2": 0}, result.logs["m1"][-2000:]
    assert agreed_sha(result) == alone
    (recovery,) = [r for r in result.results["m0"]["reconfigurations"] if r["epoch"] == 1]
    assert recovery["resume_step"] == 4


def test_a_scheduler_built_on_the_group_moves_every_members_lr() -> None:
    model = mlp()
    muon, adamw = muon_adamw(model)
    group = OptimizerGroup([muon, adamw])
    sched = torch.optim.lr_scheduler.LambdaLR(group, lambda s: 0.5**s)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler stepped before the optimizer"
        train(model, group, 1)
        sched.step()
    assert [g["lr"] for g in group.param_groups] == [0.01, 0.005]
    assert muon.param_groups[0]["lr"] == 0.01 and adamw.param_groups[0]["lr"] == 0.005
    watch = LrWatch(group)
    watch.reset()
    train(model, group, 1)
    sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.check(2, [sched])  # the group's own scheduler owns every group's lr
