"""job.evaluate: totals over a held-out set split across members, the same at any world
size and through a member lost in the middle of it; the model's modes, gradients and
generators as they were; bad input refused by name."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import keepstep
from keepstep.elastic import ConfigError
from keepstep.elastic.rng import EVAL, rng_scope
from keepstep.launch.local import LocalRun, agreed_sha, run_local

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "evaluate_job.py")
sys.path.insert(0, str(HERE))
from evaluate_job import pairs  # noqa: E402


def _job() -> tuple[nn.Sequential, keepstep.Job]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, keepstep.init(model, opt, pairs(64, seed=1), 16, 4, seed=5, env={})


def test_the_totals_are_fns_summed_over_every_batch_in_eval_mode() -> None:
    model, job = _job()
    model[1].eval()  # a module the script keeps in eval mode stays so
    held_out = pairs(21, seed=2)
    seen: list[int] = []

    def fn(batch: list[torch.Tensor]) -> dict[str, object]:
        x, y = batch
        assert not model.training and not torch.is_grad_enabled()
        seen.append(len(y))
        noise = torch.rand(()) + random.random()  # keyed by (seed, step, batch)
        return {"loss": F.mse_loss(model(x), y, reduction="sum") + noise, "n": len(y)}

    before = torch.get_rng_state(), random.getstate()
    totals = job.evaluate(held_out, fn, names=["loss", "n"], batch_size=8)
    assert (torch.equal(torch.get_rng_state(), before[0]), random.getstate()) == (True, before[1])
    assert seen == [8, 8, 5] and totals["n"] == 21.0
    assert model.training and model[0].training and not model[1].training
    again = job.evaluate(held_out, fn, names=["loss", "n"], batch_size=8)
    assert again == totals  # the same draws for the same step and batch
    model.eval()
    expected = 0.0
    with torch.no_grad():
        for b in range(3):  # in batch order, each batch's draws keyed as evaluate keys them
            x, y = held_out[b * 8 : (b + 1) * 8]
            with rng_scope(5, job.done, b, purpose=EVAL):
                noise = torch.rand(()) + random.random()
                expected += (F.mse_loss(model(x), y, reduction="sum") + noise).item()
    assert totals["loss"] == expected


def test_bad_evaluations_are_refused_by_name() -> None:
    _, job = _job()
    data = pairs(8, seed=2)

    def fn(batch: list[torch.Tensor]) -> dict[str, object]:
        return {"loss": 1.0}

    with pytest.raises(ConfigError, match=r"names='loss': the quantities fn returns"):
        job.evaluate(data, fn, names="loss", batch_size=4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"names=\['a', 'a'\]: distinct strings"):
        job.evaluate(data, fn, names=["a", "a"], batch_size=4)
    with pytest.raises(ConfigError, match=r"fn returned \['loss'\] for batch 0; names=\['n'\]"):
        job.evaluate(data, fn, names=["n"], batch_size=4)
    with pytest.raises(ConfigError, match=r"fn's 'loss' for batch 0 is 'x', not a number"):
        job.evaluate(data, lambda b: {"loss": "x"}, names=["loss"], batch_size=4)
    with pytest.raises(ConfigError, match="batch_size=0 must be an int >= 1"):
        job.evaluate(data, fn, names=["loss"], batch_size=0)
    with pytest.raises(ConfigError, match="the dataset is empty"):
        job.evaluate([], fn, names=["loss"], batch_size=4)
    with pytest.raises(ConfigError, match="a DataLoader"):
        job.evaluate(DataLoader(data), fn, names=["loss"], batch_size=4)


@pytest.mark.slow
def test_totals_are_the_same_alone_and_through_a_member_lost_while_evaluating(
    tmp_path: Path,
) -> None:
    def launch(name: str, schedule: list[list[str]], env: dict[str, str], **kw: object) -> dict:
        run = LocalRun(
            script=JOB, steps=8, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        result = run_local(run, tmp_path / name, {**os.environ, **env})
        evals = {}
        for member, code in result.returncodes.items():
            assert code == (-9 if member in kw.get("crash", {}) else 0), result.logs[member]
            evals[member] = re.findall(r"eval step=\d+ .*", result.logs[member])
        return {"sha": agreed_sha(result), "evals": evals, "logs": result.logs}

    alone = launch("alone", [["m0"]], {})
    assert len(alone["evals"]["m0"]) == 4  # steps 1, 3, 5, 7
    lost = launch(
        "lost", [["m0", "m1", "m2"], ["m0", "m2"]], {"EVAL_KILL": f"m1:{tmp_path / 'flag'}"},
        at_step=[0, None], crash={"m1": 6},  # m1 kills itself evaluating at step 3
    )  # fmt: skip
    assert lost["sha"] == alone["sha"]
    for member in ("m0", "m2"):
        assert lost["evals"][member] == alone["evals"]["m0"]
        assert "computing the other members' batches here" in lost["logs"][member]
    assert lost["evals"]["m1"] == alone["evals"]["m0"][:1]  # before it was lost
