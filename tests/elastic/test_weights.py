"""A weighted mean (weighted_mean=True): the weights a micro-batch may give, the gradient
they make (summed over the summed weights), and its bits at any world size."""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import keepstep
from keepstep.elastic import ConfigError
from keepstep.elastic.metrics import StepMetrics
from keepstep.elastic.reduce_base import check_total_weight
from keepstep.elastic.weights import check_exact_in, micro_batch_weight
from keepstep.launch.local import LocalRun, agreed_sha, run_local

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "weighted_job.py")
sys.path.insert(0, str(HERE))
from weighted_job import IGNORE, Model, loss_sum, padded_tokens  # noqa: E402


def test_a_weight_is_a_count_given_exactly_when_the_job_is_weighted() -> None:
    assert micro_batch_weight(7, True) == 7
    assert micro_batch_weight(torch.tensor(5), True) == 5
    assert micro_batch_weight(torch.tensor([3], dtype=torch.int32), True) == 3
    assert micro_batch_weight(0, True) == 0  # a micro-batch of padding only
    assert micro_batch_weight(None, False) == 0
    with pytest.raises(ConfigError, match=r"weight=4\) needs keepstep.init\(.*weighted_mean"):
        micro_batch_weight(4, False)
    with pytest.raises(ConfigError, match=r"step.backward\(loss_sum, weight=n\)"):
        micro_batch_weight(None, True)
    with pytest.raises(ConfigError, match=r"torch.float32 tensor of shape \(\)"):
        micro_batch_weight(torch.tensor(2.0), True)
    with pytest.raises(ConfigError, match=r"int64 tensor of shape \(2,\)"):
        micro_batch_weight(torch.tensor([1, 2]), True)
    with pytest.raises(ConfigError, match=r"weight=2.5: a weight is a count"):
        micro_batch_weight(2.5, True)
    with pytest.raises(ConfigError, match="not a bool"):
        micro_batch_weight(True, True)
    with pytest.raises(ConfigError, match="weight=-1: a count must be >= 0"):
        micro_batch_weight(-1, True)
    assert check_exact_in(2**24 - 1, torch.float32) == 2**24 - 1
    with pytest.raises(ConfigError, match=r"beyond the 2\*\*24 a torch.float32"):
        check_exact_in(2**24, torch.float32)
    assert check_exact_in(2**40, torch.float64) == 2**40
    with pytest.raises(ConfigError, match="sum to 0"):
        check_total_weight(0)


def _reference(model: Model, data: torch.utils.data.Dataset, ids: list[list[int]]) -> dict:
    """The global batch's token-mean gradient in float64, from one process's autograd."""
    ref = copy.deepcopy(model).double().eval()  # no dropout: the job's runs without too
    grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    total = 0
    for indices in ids:
        tokens = torch.stack([data[i][0] for i in indices])
        targets = torch.stack([data[i][1] for i in indices])
        ref.zero_grad()
        loss_sum(ref, tokens, targets).backward()
        for n, p in ref.named_parameters():
            grads[n] += p.grad
        total += int((targets != IGNORE).sum())
    return {n: g / total for n, g in grads.items()}


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_gradient_is_the_global_batchs_mean_per_token(mode: str) -> None:
    data = padded_tokens(64, seed=3)
    torch.manual_seed(0)
    model = Model()
    model.drop.p = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = keepstep.init(
        model, opt, data, 16, 4, seed=1, mode=mode, weighted_mean=True, metrics=["loss"], env={}
    )
    seen: dict[str, torch.Tensor] = {}
    job.before_optimizer_step(
        lambda m, _: seen.update({n: p.grad.clone() for n, p in m.named_parameters()})
    )
    start = copy.deepcopy(model)
    sums, counts = [], []
    for step in job.steps(1):
        ids = []
        for mb in step.micro_batches():
            ids.append(list(mb.indices))
            inputs, targets = mb.inputs, mb.targets
            loss, count = loss_sum(model, inputs, targets), (targets != IGNORE).sum()
            sums.append(float(loss.detach()))
            counts.append(int(count))
            step.log(loss=loss / count)
            step.backward(loss, weight=count)
        result = step.commit()
    assert result
    assert result.metrics["loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-6)  # fp32
    mean_of_means = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(sums)
    assert result.metrics["loss"] != pytest.approx(mean_of_means)
    want = _reference(start, data, ids)
    for name, grad in seen.items():
        torch.testing.assert_close(grad.double(), want[name], rtol=1e-5, atol=1e-7)
    # The lengths vary: the mean of the micro-batches' means is another gradient.
    per_mb = [_reference(start, data, [i]) for i in ids]
    mean_of_means = sum(g["head.weight"] for g in per_mb) / len(ids)
    assert not torch.allclose(mean_of_means, want["head.weight"], rtol=1e-3)


def test_a_step_whose_weights_sum_to_zero_is_refused_by_name() -> None:
    data = padded_tokens(16, seed=3)
    model = Model()
    job = keepstep.init(model, torch.optim.SGD(model.parameters(), lr=0.1), data, 8, 4,
                        weighted_mean=True, env={})  # fmt: skip
    for step in job.steps(1):
        for mb in step.micro_batches():
            step.backward(0.0 * loss_sum(model, mb.inputs, mb.targets), weight=0)
        with pytest.raises(ConfigError, match="step 0: the weights of all its micro-batches"):
            step.commit()
        return


@pytest.mark.slow
def test_a_weighted_job_ends_identical_alone_sharded_and_through_a_crash(tmp_path: Path) -> None:
    def launch(name: str, schedule: list[list[str]], env: dict[str, str], **kw: object) -> str:
        run = LocalRun(
            script=JOB, steps=8, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        result = run_local(run, tmp_path / name, {**os.environ, **env})
        for member, code in result.returncodes.items():
            assert code == 0, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
            curve = re.findall(r"losses=\[(.*)\]", result.logs[member])[-1].split(", ")
            curves.append(curve)  # a restarted member's: the steps after its restart
        return agreed_sha(result)

    curves: list[list[str]] = []

    alone = launch("alone", [["m0"]], {})
    three = [["m0", "m1", "m2"], ["m0", "m2"], ["m0", "m1", "m2"]]
    crash = launch(
        "crash", three, {}, at_step=[0, None, 5], crash={"m1": 3}, restart={"m1": 2},
        timeout_scale=4.0,
    )  # fmt: skip
    zero2 = launch("zero2", [["m0", "m1"]], {"KEEPSTEP_SHARD": "zero2"})
    assert crash == alone and zero2 == alone
    full = curves[0]  # alone's: every step's token-mean loss
    assert len(full) == 8 and all(c == full[len(full) - len(c) :] for c in curves), curves


def test_a_weighted_jobs_metrics_weigh_each_micro_batch_by_its_weight() -> None:
    metrics = StepMetrics(["loss", "lr"], n_micro=3, weighted=True)
    for mb, (loss, weight) in enumerate([(2.0, 10), (float("nan"), 0), (5.0, 30)]):
        metrics.log(mb, {"loss": loss, "lr": 0.5})
        metrics.weights[mb] = weight
    out = metrics.reduce(metrics.buffer(), step=0)
    assert out == {"loss": (2.0 * 10 + 5.0 * 30) / 40, "lr": 0.5}  # weight 0: not read
    plain = StepMetrics(["loss"], n_micro=2)
    plain.log(0, {"loss": 1.0}), plain.log(1, {"loss": 2.0})
    assert plain.buffer().numel() == 4 and plain.reduce(plain.buffer(), 0) == {"loss": 1.5}
