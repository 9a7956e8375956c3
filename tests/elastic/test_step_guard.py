"""The optimizer is the job's to step inside job.steps() (step_guard.py): a ported loop's
own clip-and-step is refused by name, before it can train unclipped; outside the loop the
optimizer is the script's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, Job


def _job(optimizers: int = 1, **kw: object) -> tuple[nn.Module, list[torch.optim.Optimizer], Job]:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    if optimizers == 1:
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    else:
        opts = [
            torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.AdamW(model[1].parameters()),
        ]
    data = TensorDataset(x, x.sum(1, keepdim=True))
    job = keepstep.init(
        model, opts if optimizers > 1 else opts[0], data, 16, 4, seed=0, env={}, **kw
    )  # type: ignore[arg-type]
    return model, opts, job


def _backward(model: nn.Module, step: keepstep.elastic.Step) -> None:
    for mb in step.micro_batches():
        step.backward(nn.functional.mse_loss(model(mb.inputs), mb.targets))


def test_a_ported_clip_and_step_before_the_commit_is_refused_before_anything_moves() -> None:
    model, (opt,), job = _job()
    first = [p.detach().clone() for p in model.parameters()]
    for step in job.steps(2):
        before = [p.detach().clone() for p in model.parameters()]
        _backward(model, step)
        # what a plain loop does here; the job's gradient is not in .grad yet
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
        with pytest.raises(ConfigError, match=r"SGD\.step\(\) called by the script") as error:
            opt.step()
        assert "clip_grad_norm=max_norm" in str(error.value)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert step.commit()  # the job's own step is not the script's
        with pytest.raises(ConfigError, match="called by the script"):
            opt.step()  # after the commit too: the next step's gradient is the job's
    assert job.done == 2
    assert not all(torch.equal(a, b) for a, b in zip(first, model.parameters(), strict=True))


def test_outside_the_loop_the_optimizer_is_the_scripts() -> None:
    model, (opt,), job = _job()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # before job.steps(): a warm-up of the script's own
    opt.zero_grad()
    for step in job.steps(3):
        _backward(model, step)
        step.commit()
        break  # the loop is left: the generator is closed
    weight = model[1].weight.detach().clone()
    model[1].weight.grad = torch.ones_like(weight)
    opt.step()
    assert torch.equal(model[1].weight.detach(), weight - 0.1)


def test_a_list_of_optimizers_guards_each_and_a_hook_may_not_step() -> None:
    model, (_sgd, adamw), job = _job(optimizers=2)
    job.before_optimizer_step(lambda model, optimizer: optimizer.step())
    for step in job.steps(1):
        _backward(model, step)
        with pytest.raises(ConfigError, match=r"AdamW\.step\(\) called by the script"):
            adamw.step()
        with pytest.raises(ConfigError, match=r"SGD\.step\(\) called by the script"):
            step.commit()  # the hook's step, not the job's
        return


@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_a_sharded_job_steps_its_shards_and_refuses_the_scripts_step(shard: str) -> None:
    model, (opt,), job = _job(shard=shard)  # ZeRO refuses the script's step hooks, not this
    for step in job.steps(2):
        _backward(model, step)
        with pytest.raises(ConfigError, match=r"SGD\.step\(\) called by the script"):
            opt.step()
        assert step.commit()
    assert job.done == 2


def test_the_amp_recipes_scaler_calls_are_refused_and_the_jobs_own_still_run() -> None:
    """A ported AMP loop keeps scaler.unscale_/step/update: each is refused by name (torch
    would fail with "No inf checks were recorded"), and the job's own calls of them, at
    the commit, still unscale, step and update."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    model, (opt,), job = _job(grad_scaler=scaler)
    for step in job.steps(2):
        for mb in step.micro_batches():
            step.backward(scaler.scale(nn.functional.mse_loss(model(mb.inputs), mb.targets)))
        for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt), scaler.update):
            with pytest.raises(ConfigError, match=r"GradScaler\.\w+\(\) called by the script"):
                call()
        assert step.commit()
    assert scaler.get_scale() == 2.0**10  # grown after each of the two steps: update ran
    assert "step" in vars(scaler)  # this scaler's: another is untouched
    assert "step" not in vars(torch.amp.GradScaler("cpu"))
    job.step_guard.remove()
    assert "step" not in vars(scaler)
