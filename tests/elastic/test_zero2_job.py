"""ZeRO-2 inside the job (``shard="zero2"``): the exact sum reduce-scattered to the owners.

Members on threads of this process (one HashStore, the agents' "node/local" names) train
the same job with full replicas, ZeRO-1 and ZeRO-2; every member must end with the
parameters and the gathered optimizer state of the full run, with clipping (the norm
taken from the windows, nothing gathered: zero/clip.py), a grad scaler (the shard's
gradient unscaled in the shard optimizer) and an LR schedule. The multi-process runs
with faults are in test_shard_zero_job.py, which runs both sharded modes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, JobConfig, ScheduleController
from keepstep.elastic.config import Shard
from keepstep.elastic.reduce import ReduceMode
from keepstep.elastic.zero import ZeroOptimizer


def make() -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 6, generator=g)
    torch.manual_seed(0)
    # 6*300+300 + 300*7+7 + 7+1: tensors of several chunks, none a multiple of 128. No
    # dropout: members on threads share the global generator that keyed RNG reseeds.
    model = nn.Sequential(nn.Linear(6, 300), nn.Tanh(), nn.Linear(300, 7), nn.Linear(7, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt, TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def train(members: int, steps: int, **kw: Any) -> list[tuple[str, str]]:
    """(params_sha256, optimizer_sha256) of every member after ``steps`` steps."""
    store, names = HashStore(), [f"n{i}/0" for i in range(members)]
    jobs = []
    for me in names:
        model, opt, data = make()
        controller = ScheduleController(store_=store, me=me, schedule=[names])
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if kw.get("scaler") else None
        job = keepstep.init(
            model,
            opt,
            data,
            global_batch=24,
            micro_batch=2,
            seed=4,
            env={},
            controller=controller,
            shard=kw.get("shard"),
            clip_grad_norm=kw.get("clip"),
            grad_scaler=scaler,
        )
        sched = job.track("sched", torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
        jobs.append((job, model, sched, scaler))
    out: list[tuple[str, str]] = [("", "")] * members
    errors: list[BaseException] = []

    def member(i: int) -> None:
        job, model, sched, scaler = jobs[i]
        try:
            for step in job.steps(steps):
                for mb in step.micro_batches():
                    loss = F.mse_loss(model(mb.inputs), mb.targets)
                    step.backward(scaler.scale(loss) if scaler is not None else loss)
                if step.commit():
                    sched.step()
            out[i] = (job.params_sha256(), job.optimizer_sha256())
            job.snapshots.close()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert all(out), "a member did not finish"
    return out


@pytest.mark.parametrize(
    "kw",
    [{}, {"clip": 0.05}, {"scaler": True}, {"clip": 0.05, "scaler": True}],
    ids=["plain", "clipped", "scaled", "clipped-scaled"],
)
def test_zero2_matches_full_replicas_and_zero1(
    kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    full = train(1, 5, **kw)[0]
    gathered: list[int] = []  # ZeRO-2 clips its windows where they lie (zero/clip.py)
    real = ZeroOptimizer.gather_grads
    monkeypatch.setattr(
        ZeroOptimizer, "gather_grads", lambda z, *a: (gathered.append(1), real(z, *a))[1]
    )
    zero2 = train(3, 5, shard="zero2", **kw)
    assert zero2 == [full] * 3
    assert gathered == []
    assert train(2, 5, shard="zero1", **kw) == [full] * 2


def test_zero2_sees_one_more_step() -> None:
    assert train(2, 4, shard="zero2") != train(2, 5, shard="zero2")


def test_zero2_is_a_shard_mode_of_the_exact_mode() -> None:
    assert JobConfig(8, 4, shard="zero2").shard is Shard.ZERO2  # type: ignore[arg-type]
    model, opt, data = make()
    with pytest.raises(ConfigError, match="shard='zero2' needs mode='exact'"):
        keepstep.init(model, opt, data, 8, 4, shard="zero2", mode=ReduceMode.FAST, env={})
