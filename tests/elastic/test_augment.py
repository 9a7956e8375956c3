"""What the job reads: a DataLoader or an iterable-style dataset refused by name, and
random augmentation in the dataset keyed per micro-batch (or, with prefetch, refused);
what a loop body draws outside its micro-batches, keyed per step."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, default_collate

import keepstep
from keepstep.elastic import ConfigError
from keepstep.elastic.data import check_dataset, check_reads_draw_nothing
from keepstep.launch.local import LocalRun, agreed_sha, run_local

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "augment_job.py")
sys.path.insert(0, str(HERE))
from augment_job import Augmented  # noqa: E402


class _Stream(IterableDataset[torch.Tensor]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        yield torch.zeros(2)


def test_what_the_job_cannot_read_by_position_is_refused_by_name() -> None:
    pairs = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    with pytest.raises(ConfigError, match=r"a DataLoader.*loader\.dataset, collate_fn="):
        check_dataset(DataLoader(pairs, batch_size=4))
    with pytest.raises(ConfigError, match=r"iterable-style _Stream.*TokenFile"):
        check_dataset(_Stream())
    with pytest.raises(ConfigError, match=r"\(list_iterator\) has no __len__ or __getitem__"):
        check_dataset(iter([1, 2]))
    check_dataset(pairs)
    check_dataset([1, 2, 3])
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="a DataLoader"):
        keepstep.init(model, torch.optim.SGD(model.parameters()), DataLoader(pairs), 4, 2, env={})


@pytest.mark.parametrize("draw", ["torch", "random", "numpy"])
def test_with_prefetch_a_dataset_that_draws_is_refused_and_the_generators_kept(
    draw: str,
) -> None:
    draws = {
        "torch": lambda: torch.rand(1),
        "random": random.random,
        "numpy": np.random.rand,
    }

    class Drawing(TensorDataset):
        def __getitem__(self, i: int) -> object:
            draws[draw]()
            return super().__getitem__(i)

    data = Drawing(torch.randn(8, 2))
    held = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    with pytest.raises(ConfigError, match=f"draws from {draw}'s global generator"):
        check_reads_draw_nothing(data, default_collate)
    assert torch.equal(torch.get_rng_state(), held[0]) and random.getstate() == held[1]
    assert np.array_equal(np.random.get_state()[1], held[2])  # as the probe found them
    check_reads_draw_nothing(TensorDataset(torch.randn(8, 2)), default_collate)
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match=r"Use loader_workers=N .*, prefetch=0"):
        keepstep.init(model, torch.optim.SGD(model.parameters()), data, 4, 2, prefetch=2, env={})
    # in worker processes the same dataset's reads are keyed: accepted
    job = keepstep.init(model, torch.optim.SGD(model.parameters()), data, 4, 2, prefetch=2,
                        loader_workers=1, env={})  # fmt: skip
    job.loader.close()


def _train(history: int) -> str:
    """One member's run after ``history`` draws from every global generator."""
    torch.rand(history), [random.random() for _ in range(history)], np.random.rand(history)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    job = keepstep.init(model, torch.optim.SGD(model.parameters(), lr=0.05), Augmented(64),
                        16, 4, seed=1, env={})  # fmt: skip
    for step in job.steps(3):
        weight = 1.0 + random.random()  # outside the micro-batches: keyed by step
        for mb in step.micro_batches():
            random.random()  # the forward's draws do not move the next read's
            step.backward(weight * F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    return job.params_sha256()


def test_random_reads_and_step_draws_are_keyed_whatever_the_generators_held_before() -> None:
    assert _train(history=0) == _train(history=7)


@pytest.mark.slow
def test_an_augmenting_job_ends_identical_alone_and_through_a_crash(tmp_path: Path) -> None:
    def launch(name: str, schedule: list[list[str]], **kw: object) -> str:
        run = LocalRun(
            script=JOB, steps=6, global_batch=24, micro_batch=4, schedule=schedule, seed=3,
            timeout=100.0, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        result = run_local(run, tmp_path / name, dict(os.environ))
        for member, code in result.returncodes.items():
            assert code == 0, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
        return agreed_sha(result)

    alone = launch("alone", [["m0"]])
    three = [["m0", "m1", "m2"], ["m0", "m2"], ["m0", "m1", "m2"]]
    crash = launch(
        "crash", three, at_step=[0, None, 4], crash={"m1": 2}, restart={"m1": 2},
        timeout_scale=4.0,
    )  # fmt: skip
    assert crash == alone
    # Read in forked loader processes, each read keyed as in the training thread.
    workers = launch("workers", [["m0", "m1"]], script_args=["--workers", "2"])
    assert workers == alone
