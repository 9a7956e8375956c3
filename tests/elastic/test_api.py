"""The training-script API in one process: the loop, its errors, and its determinism."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import (
    ConfigError,
    JobConfig,
    Membership,
    ScheduleController,
    StateShapeError,
)
from keepstep.elastic.errors import PeerLost, SnapshotMissing
from keepstep.elastic.step import CommitResult, StepOutcome


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, TensorDataset]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(256, 6, generator=g)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), TensorDataset(x, y)


def train(steps: int, **kw: object) -> tuple[str, list[float]]:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=32, micro_batch=4, seed=1, env={}, **kw)
    losses = []
    for step in job.steps(steps):
        total = 0.0
        for mb in step.micro_batches():
            loss = F.mse_loss(model(mb.inputs), mb.targets)
            step.backward(loss)
            total += loss.item()
        assert step.commit()
        losses.append(total / len(step.micro_batch_ids))
    return job.params_sha256(), losses


def test_single_member_trains_and_is_repeatable() -> None:
    sha1, losses = train(15)
    sha2, _ = train(15)
    assert sha1 == sha2
    assert losses[-1] < losses[0] / 2


def test_global_batch_must_divide() -> None:
    model, opt, data = make()
    with pytest.raises(ConfigError, match=r"global_batch=30.*micro_batch=4"):
        keepstep.init(model, opt, data, global_batch=30, micro_batch=4, env={})


def test_launcher_and_script_must_agree() -> None:
    model, opt, data = make()
    with pytest.raises(ConfigError, match=r"global_batch=32.*KEEPSTEP_GLOBAL_BATCH=64"):
        keepstep.init(
            model, opt, data, global_batch=32, micro_batch=4, env={"KEEPSTEP_GLOBAL_BATCH": "64"}
        )


def test_missing_batch_sizes_are_named() -> None:
    model, opt, data = make()
    with pytest.raises(ConfigError, match="global_batch=None"):
        keepstep.init(model, opt, data, micro_batch=4, env={})


def test_more_members_than_micro_batches_is_refused_before_any_rendezvous() -> None:
    model, opt, data = make()
    members = [f"m{i}" for i in range(9)]
    controller = ScheduleController(
        store_=torch.distributed.HashStore(), me="m0", schedule=[members]
    )
    job = keepstep.init(
        model, opt, data, global_batch=32, micro_batch=4, env={}, controller=controller
    )
    with pytest.raises(ConfigError, match="9 members but only 8 micro-batches"):
        next(iter(job.steps(3)))


def test_backward_once_per_micro_batch() -> None:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={})
    step = next(iter(job.steps(1)))
    with pytest.raises(ConfigError, match=r"ended without step\.backward"):
        for _mb in step.micro_batches():
            pass


def test_commit_needs_every_micro_batch() -> None:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={})
    step = next(iter(job.steps(1)))
    with pytest.raises(ConfigError, match="commit after 0 of 2 micro-batches"):
        step.commit()


def test_a_model_whose_state_changes_shape_is_refused() -> None:
    model, opt, data = make()
    job = keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={})
    steps = iter(job.steps(3))
    step = next(steps)
    for mb in step.micro_batches():
        step.backward(F.mse_loss(model(mb.inputs), mb.targets))
    assert step.commit()
    model[3] = nn.Linear(16, 2)  # the head grows: the snapshot layout no longer fits
    step = next(steps)
    for mb in step.micro_batches():
        step.backward(model(mb.inputs).sum())
    with pytest.raises(StateShapeError, match=r"3\.weight"):
        step.commit()


def test_membership_must_be_sorted() -> None:
    with pytest.raises(ConfigError, match="sorted and unique"):
        Membership(0, ("b", "a"), "a")


@pytest.mark.parametrize("scale", [0.5, 0.0, float("nan"), float("inf")])
def test_membership_timeouts_can_only_be_raised(scale: float) -> None:
    with pytest.raises(ConfigError, match=f"timeout_scale={scale} must be a number >= 1"):
        Membership(0, ("a",), "a", timeout_scale=scale)


def test_a_failed_step_leaves_its_reduction_buffer_to_the_dead_epoch() -> None:
    # The failed all-reduce of step 3 keeps its tensor (a stopped peer can complete it
    # later, see test_comm); its late writes must not reach the repeated step.
    clean_sha, _ = train(6)
    model, opt, data = make()
    controller = ScheduleController(
        store_=torch.distributed.HashStore(), me="m0", schedule=[["m0"], ["m0"]], at_step=[0, None]
    )
    job = keepstep.init(
        model, opt, data, global_batch=32, micro_batch=4, seed=1, env={}, controller=controller
    )
    handed: list[torch.Tensor] = []
    for step in job.steps(6):
        comm = job.comm
        assert comm is not None
        if step.index == 3 and comm.epoch == 0:

            def lost(tensor: torch.Tensor, *_: object) -> None:
                handed.append(tensor)
                raise PeerLost(0, "m1 stopped")

            comm.allreduce = lost  # type: ignore[method-assign]
        for mb in step.micro_batches():
            if handed:
                handed[0].fill_(12345)  # the dead epoch's work completing late
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    assert [r.epoch for r in controller.reconfigurations] == [0, 1]
    assert handed and job.params_sha256() == clean_sha


def test_the_launchers_host_is_the_address_gloo_binds() -> None:
    # A pod's IP, or a node's network-namespace address: 127.0.0.1 there is the node's own
    # loopback, which no peer can reach.
    model, opt, data = make()
    job = keepstep.init(
        model, opt, data, global_batch=32, micro_batch=4, env={"KEEPSTEP_HOST": "127.0.0.3"}
    )
    assert job.config.host == "127.0.0.3"
    model, opt, data = make()
    assert keepstep.init(model, opt, data, global_batch=32, micro_batch=4, env={}).config.host == (
        "127.0.0.1"
    )


def test_the_launchers_step_count_is_validated_at_init_and_used_by_steps() -> None:
    model, opt, data = make()
    job = keepstep.init(
        model, opt, data, global_batch=8, micro_batch=4, env={"KEEPSTEP_STEPS": "2"}
    )
    assert job.config.planned_steps == 2
    for step in job.steps():
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    assert job.done == 2
    model, opt, data = make()
    with pytest.raises(ConfigError, match=r"planned_steps=-1 must be an integer >= 0"):
        keepstep.init(model, opt, data, global_batch=8, micro_batch=4, env={"KEEPSTEP_STEPS": "-1"})
    job = keepstep.init(*make(), global_batch=8, micro_batch=4, env={})
    with pytest.raises(ConfigError, match="needs a step count"):
        next(iter(job.steps()))


def test_a_script_asking_for_more_steps_than_the_launcher_is_refused_before_training() -> None:
    # The launcher counts the job done at its count: more steps would be trained, then the
    # run called a failure. Fewer are a segment of it (the script may call steps() again).
    finished: list[int] = []

    class Finishes(ScheduleController):
        def on_finish(self, done: int, params_sha256: str) -> None:
            finished.append(done)

    model, opt, data = make()
    controller = Finishes(store_=HashStore(), me="0", schedule=[["0"]])
    job = keepstep.init(model, opt, data, 8, 4, env={"KEEPSTEP_STEPS": "3"}, controller=controller)
    with pytest.raises(ConfigError, match=r"job\.steps\(4\) but the launcher set KEEPSTEP_STEPS=3"):
        next(iter(job.steps(4)))
    assert job.done == 0
    for total in (2, 3):
        for step in job.steps(total):
            for mb in step.micro_batches():
                step.backward(F.mse_loss(model(mb.inputs), mb.targets))
            step.commit()
        assert job.done == total
    # Only the end of the launcher's count finishes the worker's part (the agent then
    # counts it done and releases its store connections): not the end of a segment.
    assert finished == [3]
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=rf"steps={bad!r} must be an int >= 0"):
            next(iter(job.steps(bad)))  # type: ignore[arg-type]


def test_a_dataset_smaller_than_the_global_batch_is_warned_about() -> None:
    model, opt, _ = make()
    small = TensorDataset(torch.randn(20, 6), torch.randn(20, 1))
    with pytest.warns(UserWarning, match=r"holds 20 samples, fewer than global_batch=32"):
        keepstep.init(model, opt, small, global_batch=32, micro_batch=4, env={})


def test_a_bad_mode_or_thread_count_is_named_with_what_is_allowed() -> None:
    model, opt, data = make()
    with pytest.raises(ConfigError, match=r"mode='exakt': must be one of 'exact', 'fast'"):
        keepstep.init(model, opt, data, 8, 4, mode="exakt", env={})
    with pytest.raises(ConfigError, match=r"KEEPSTEP_MODE='exakt'|mode='exakt'"):
        keepstep.init(model, opt, data, 8, 4, env={"KEEPSTEP_MODE": "exakt"})
    with pytest.raises(ConfigError, match=r"threads=0 must be an integer >= 1"):
        keepstep.init(model, opt, data, 8, 4, threads=0, env={})


def test_job_config_names_a_bad_host_or_step_count() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"host": ""}, "host='' must be a non-empty address or hostname"),
        ({"host": "  "}, "host='  ' must be a non-empty address or hostname"),
        ({"planned_steps": -3}, "planned_steps=-3 must be an integer >= 0 (or None)"),
        ({"planned_steps": True}, "planned_steps=True must be an integer >= 0 (or None)"),
        ({"planned_steps": 2.5}, "planned_steps=2.5 must be an integer >= 0 (or None)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            JobConfig(global_batch=8, micro_batch=4, **kwargs)  # type: ignore[arg-type]
    config = JobConfig(global_batch=8, micro_batch=4, host="10.0.0.7", planned_steps=0)
    assert (config.host, config.planned_steps) == ("10.0.0.7", 0)


def test_the_collective_bound_comes_from_the_script_or_the_launcher() -> None:
    model, opt, data = make()
    assert keepstep.init(model, opt, data, 8, 4, env={}).config.collective_timeout == 30.0
    job = keepstep.init(model, opt, data, 8, 4, collective_timeout=120, env={})
    assert job.config.collective_timeout == 120
    env = {"KEEPSTEP_COLLECTIVE_TIMEOUT": "90.5"}
    assert keepstep.init(model, opt, data, 8, 4, env=env).config.collective_timeout == 90.5
    with pytest.raises(ConfigError, match=r"collective_timeout=60.*KEEPSTEP_COLLECTIVE_TIMEOUT=90"):
        keepstep.init(model, opt, data, 8, 4, collective_timeout=60, env=env)
    with pytest.raises(ConfigError, match=r"KEEPSTEP_COLLECTIVE_TIMEOUT='soon' is not a valid"):
        keepstep.init(model, opt, data, 8, 4, env={"KEEPSTEP_COLLECTIVE_TIMEOUT": "soon"})
    for bad in (0, -1.0, float("nan"), float("inf"), True, "60"):
        message = f"collective_timeout={bad!r} must be a number of seconds > 0"
        with pytest.raises(ConfigError, match=re.escape(message)):
            JobConfig(global_batch=8, micro_batch=4, collective_timeout=bad)  # type: ignore[arg-type]


def test_a_member_that_never_comes_is_given_up_after_the_jobs_collective_bound() -> None:
    """Epoch 0 names a member that never starts: the first epoch's group waits the job's
    collective bound for it (not the 30 s default), then the survivor trains alone."""
    model, opt, data = make()
    controller = ScheduleController(
        store_=HashStore(), me="a", schedule=[["a", "b"], ["a"]], at_step=[0, None]
    )
    job = keepstep.init(
        model, opt, data, 32, 4, seed=1, env={}, controller=controller, collective_timeout=0.5
    )
    begin = time.monotonic()
    for step in job.steps(2):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(model(mb.inputs), mb.targets))
        step.commit()
    assert time.monotonic() - begin < 15.0  # the 30 s default would have waited longer
    assert [r.epoch for r in controller.reconfigurations] == [1]  # epoch 0 never built
    assert job.params_sha256() == train(2)[0]


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
