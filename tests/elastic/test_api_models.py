"""The training-script API with the models, data and loops people write: compiled models,
samples that are not pairs, activation checkpointing, sparse and late gradients, what a
commit returns, and a worker started to resume from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from api_model import make, train
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, ScheduleController
from keepstep.elastic.errors import SnapshotMissing
from keepstep.elastic.step import CommitResult, StepOutcome


def test_a_compiled_model_is_snapshotted_and_hashed_under_its_own_names() -> None:
    """``torch.compile`` wraps the model in a module whose state_dict prefixes every key
    with ``_orig_mod.``; the job keeps the wrapped module's names, so a compiled run's
    snapshots, checkpoints and hash match an eager run's (dynamo without a code generator
    runs the same ops, so here the bits match too)."""
    model, opt, data = make()
    compiled = torch.compile(model, backend="eager")
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    job = keepstep.init(compiled, opt, data, global_batch=32, micro_batch=4, seed=1, env={})
    for step in job.steps(2):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(compiled(mb.inputs), mb.targets))
        step.commit()
    names = set(job.snapshots.load(job.done).tensors)
    assert "model/0.weight" in names and not any("_orig_mod" in n for n in names)
    assert job.params_sha256() == train(2)[0]


class _Samples(torch.utils.data.Dataset[Any]):
    """Samples of another shape than (inputs, targets): what ``make`` returns, as given."""

    def __init__(self, make: Any) -> None:
        self.make = make

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> Any:
        return self.make(i)


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        (
            lambda i: {"x": torch.full((6,), float(i)), "y": torch.zeros(1)},
            r"mb\.inputs: this micro-batch's data is a mapping \(keys 'x', 'y'\), not "
            r"\(inputs, targets\) pairs: read mb\.data\[key\]",
        ),
        (
            lambda i: torch.full((6,), float(i)),
            r"mb\.inputs: the samples are not \(inputs, targets\) pairs \(collated into one "
            r"tensor of shape \(4, 6\)\): read mb\.data",
        ),
    ],
)
def test_inputs_of_samples_that_are_not_pairs_are_refused_by_name(
    sample: Any, message: str
) -> None:
    """A batch of single tensors would otherwise give its first sample as the inputs."""
    model, opt, _ = make()
    job = keepstep.init(model, opt, _Samples(sample), global_batch=8, micro_batch=4, env={})
    step = next(iter(job.steps(1)))
    mb = next(iter(step.micro_batches()))
    assert len(mb.indices) == 4
    with pytest.raises(ConfigError, match=message):
        mb.inputs  # noqa: B018
    x = mb.data["x"] if isinstance(mb.data, dict) else mb.data  # the data is all there
    assert x.shape == (4, 6) and x[:, 0].tolist() == [float(i) for i in mb.indices]


def test_a_parameter_unfrozen_after_init_is_refused_at_its_first_gradient() -> None:
    """The reduction covers the parameters that required grad at init; one unfrozen later
    would be stepped with this member's own, unreduced gradient."""
    model, opt, data = make()
    first = model[0]
    assert isinstance(first, nn.Linear)
    first.weight.requires_grad_(False)
    job = keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={})
    for step in job.steps(2):
        if step.index == 1:
            first.weight.requires_grad_(True)
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            if step.index == 0:
                step.backward(loss)  # frozen: no gradient, nothing to refuse
                continue
            with pytest.raises(ConfigError, match=r"parameter '0\.weight' has a gradient, but"):
                step.backward(loss)
            return
        step.commit()
    raise AssertionError("step 1 never ran")


class _Checkpointed(nn.Module):
    """A dropout block run plain, or under activation checkpointing (recomputed in
    backward, with the random state its forward had)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 6)  # so the block's input requires grad, as reentrant needs
        self.block = nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 6))
        self.head = nn.Linear(6, 1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.how == "plain":
            return self.head(self.block(h))
        reentrant = self.how == "reentrant"
        return self.head(checkpoint(self.block, h, use_reentrant=reentrant))


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_the_plain_models_bits(how: str) -> None:
    """The recompute replays the keyed dropout masks: the same gradient, bit for bit."""
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(4))
    data = TensorDataset(x, x.sum(1, keepdim=True))

    def run(kind: str) -> str:
        model = _Checkpointed(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        job = keepstep.init(model, opt, data, 16, 4, seed=2, env={})
        for step in job.steps(4):
            for mb in step.micro_batches():
                step.backward(F.mse_loss(model(mb.inputs), mb.targets))
            step.commit()
        return job.params_sha256()

    assert run(how) == run("plain")


class _Lookup(nn.Module):
    """Token embeddings summed into a linear head, looked up as ``F.embedding`` is told."""

    def __init__(self, module_sparse: bool, lookup_sparse: bool) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 6, sparse=module_sparse)
        self.head = nn.Linear(6, 1)
        self.lookup_sparse = lookup_sparse

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(tokens, self.table.weight, sparse=self.lookup_sparse)
        return self.head(rows.sum(1))


def test_sparse_gradients_are_refused_by_name_before_the_reduction() -> None:
    data = TensorDataset(torch.randint(0, 10, (16, 3)), torch.randn(16, 1))
    model = _Lookup(module_sparse=True, lookup_sparse=True)
    opt = torch.optim.SparseAdam(model.table.parameters())
    with pytest.raises(ConfigError, match=r"Embedding 'table' has sparse=True: the exact"):
        keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={})
    model.table.weight.requires_grad_(False)  # a frozen sparse table makes no gradient
    keepstep.init(model, torch.optim.SGD(model.head.parameters()), data, 8, 4, env={})
    functional = _Lookup(module_sparse=False, lookup_sparse=True)  # no module says so
    job = keepstep.init(functional, torch.optim.SGD(functional.parameters()), data, 8, 4, env={})
    for step in job.steps(1):
        for mb in step.micro_batches():
            loss = F.mse_loss(functional(mb.inputs), mb.targets)
            with pytest.raises(ConfigError, match=r"'table\.weight' has a torch\.sparse_coo"):
                step.backward(loss)
            return
    raise AssertionError("step 0 never ran")


def test_commit_returns_what_the_job_applies() -> None:
    model, opt, data = make()
    controller = ScheduleController(
        store_=torch.distributed.HashStore(), me="m0", schedule=[["m0"]]
    )
    job = keepstep.init(
        model, opt, data, global_batch=8, micro_batch=4, env={}, controller=controller
    )
    steps = iter(job.steps(2))
    step = next(steps)
    for mb in step.micro_batches():
        step.backward(F.mse_loss(model(mb.inputs), mb.targets))
    result = step.commit()
    assert result and result is step.result and step.outcome is StepOutcome.COMMITTED
    assert result.record is not None and result.record.step == 0 and not result.announced
    assert job.done == 1  # the state changed in commit()...
    assert controller.commits == []  # ...the job reports it when it takes the result
    step = next(steps)
    assert [c.step for c in controller.commits] == [0]
    # The reported record adds the snapshot's seconds, wall and CPU, to the step's.
    reported = controller.commits[0]
    assert 0 < result.record.cpu_s <= reported.cpu_s
    assert result.record.step_s <= reported.step_s
    with pytest.raises(ConfigError, match="has a record iff it committed"):
        CommitResult(StepOutcome.RETRY, record=result.record)
    assert not CommitResult(StepOutcome.RETRY)


def test_a_worker_started_to_resume_holds_the_checkpoint_until_it_commits(
    tmp_path: Path,
) -> None:
    """KEEPSTEP_RESUME names the checkpoint its agent wrote: a worker whose snapshot file
    holds nothing starts from it, held in memory until its own commits replace it, and
    ends with the numbers of a run that never stopped; one that holds a snapshot (a
    restart after its first commits) takes its own."""
    reference, _ = train(10)
    model, opt, data = make()
    first = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env={})
    for step in first.steps(6):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        assert step.commit()
    first.snapshots.wait()
    checkpoint = tmp_path / "resume.ckpt"
    checkpoint.write_bytes(first.snapshots.export(6))
    env = {"KEEPSTEP_RESUME": str(checkpoint), "KEEPSTEP_SNAPSHOT": str(tmp_path / "snap")}
    model, opt, data = make(seed=5)  # other initial weights: the checkpoint's must win
    job = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env=env)
    assert job.done == 6 and [i.step for i in job.snapshots.infos()] == [6]
    for step in job.steps(10):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        assert step.commit()
    assert job.params_sha256() == reference
    job.snapshots.wait()
    assert [i.step for i in job.snapshots.infos()] == [10, 9]  # the checkpoint is gone
    job.snapshots.close()
    model, opt, data = make()
    again = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env=env)
    assert again.done == 10  # its own snapshot, not the checkpoint
    with pytest.raises(SnapshotMissing, match="the checkpoint to resume from"):
        env = {"KEEPSTEP_RESUME": str(tmp_path / "absent")}
        keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env=env)
