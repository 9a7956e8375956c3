"""`step.log` and prefetching in a job: the logged loss is the same value at any world size,
a script that logs on one member only is refused on every member, and a prefetching
loader trains to the same bits as reading on demand.

Members run on threads of this process over one HashStore (as test_mixed_precision.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, Job, ScheduleController
from keepstep.elastic.board import Board, open_board
from keepstep.elastic.metrics import StepMetrics

GB, MB, SEED, STEPS = 24, 2, 5, 6


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(120, 5, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


@dataclass
class Member:
    job: Job
    net: nn.Module
    log_on: bool = True
    losses: list[dict[str, float]] = field(default_factory=list)
    error: BaseException | None = None

    def train(self) -> None:
        try:
            for step in self.job.steps(STEPS):
                for mb in step.micro_batches():
                    loss = F.mse_loss(self.net(mb.inputs), mb.targets)
                    if self.log_on:
                        step.log(loss=loss, first=float(mb.indices[0]))
                    step.backward(loss)
                result = step.commit()
                if result:
                    self.losses.append(dict(result.metrics))
            self.job.snapshots.close()
        except BaseException as error:  # re-raised by the test thread
            self.error = error


class Scalars:
    """A stand-in for torch's SummaryWriter (the tensorboard package is not installed here):
    what was written, by whom."""

    def __init__(self, folder: str, seen: list[tuple[str, str, float, int]]) -> None:
        self.folder, self.seen = folder, seen

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.seen.append((self.folder, tag, scalar_value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def run(
    n: int, prefetch: int = 0, silent: int | None = None, boards: list[Any] | None = None
) -> list[Member]:
    """`n` members on threads; member `silent` logs nothing; `boards`: each member's
    TensorBoard writer is a `Scalars` that appends to this list."""
    store, names = HashStore(), [f"m{i}" for i in range(n)]
    members = []
    for i, me in enumerate(names):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
        job = keepstep.init(
            net,
            torch.optim.SGD(net.parameters(), lr=0.05),
            dataset(),
            GB,
            MB,
            SEED,
            env={},
            controller=ScheduleController(store_=store, me=me, schedule=[names]),
            metrics=("loss", "first"),
            prefetch=prefetch,
        )
        if boards is not None:
            job.board = Board(f"tb-{me}", lambda folder: Scalars(folder, boards))
        members.append(Member(job, net, log_on=i != silent))
    threads = [threading.Thread(target=m.train, daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a member hung"
    return members


def test_the_logged_loss_is_the_same_value_at_any_world_size() -> None:
    curves = []
    for n in (1, 2, 3, 4):
        members = run(n)
        for m in members:
            if m.error is not None:
                raise m.error
        assert all(m.losses == members[0].losses for m in members)  # every member, same values
        curves.append(members[0].losses)
    assert all(c == curves[0] for c in curves), curves
    assert len(curves[0]) == STEPS and curves[0][-1]["loss"] < curves[0][0]["loss"]


def test_the_leader_alone_writes_the_reduced_metrics_to_tensorboard() -> None:
    seen: list[tuple[str, str, float, int]] = []
    members = run(3, boards=seen)
    for m in members:
        if m.error is not None:
            raise m.error
    assert {folder for folder, *_ in seen} == {"tb-m0"}  # the leader's writer only
    expected = [("loss", c["loss"], i) for i, c in enumerate(members[0].losses)]
    assert [(tag, value, step) for _, tag, value, step in seen if tag == "loss"] == expected


def test_tensorboard_without_the_package_is_refused_before_training(tmp_path: Any) -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"needs the tensorboard package"):
            open_board(str(tmp_path))
    else:
        assert open_board(str(tmp_path)).log_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="must name a folder"):
        open_board("")
    broken = Board("x", lambda folder: (_ for _ in ()).throw(OSError("disk full")))
    broken.write(0, {"loss": 1.0})  # reported once, then off: never stops training
    broken.write(1, {"loss": 1.0})


def test_a_member_that_logs_nothing_is_refused_on_every_member() -> None:
    members = run(3, silent=1)
    for m in members:
        assert isinstance(m.error, ConfigError), m.error
        assert "metric 'loss' was logged for 8 of 12 micro-batches" in str(m.error)


def test_prefetching_trains_to_the_same_bits_and_logs() -> None:
    plain, ahead = run(2), run(2, prefetch=3)
    for m in plain + ahead:
        if m.error is not None:
            raise m.error
    assert ahead[0].job.params_sha256() == plain[0].job.params_sha256()
    assert ahead[0].losses == plain[0].losses
    assert ahead[0].job.loader.hits > 0


def test_step_metrics_reduce_in_micro_batch_order() -> None:
    a, b = StepMetrics(("loss",), 4), StepMetrics(("loss",), 4)
    a.log(0, {"loss": 0.1})
    a.log(3, {"loss": torch.tensor(0.4)})
    b.log(1, {"loss": 0.2})
    b.log(2, {"loss": 0.3})
    summed = a.buffer() + b.buffer()
    total = 0.0
    for v in (0.1, 0.2, 0.3, float(torch.tensor(0.4))):  # a float32 loss, as logged
        total += v
    assert a.reduce(summed, 0) == {"loss": total / 4}


def test_the_buffer_goes_to_the_communicators_device() -> None:
    """NCCL reduces device tensors only: the step asks for the buffer on comm.device."""
    m = StepMetrics(("loss",), 2)
    m.log(1, {"loss": 0.5})
    assert m.buffer().device.type == "cpu"
    moved = m.buffer(torch.device("meta"))  # any device: the values move as they are
    assert moved.device.type == "meta" and moved.shape == (4,)


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"acc": 1.0}, "'acc' is not a declared metric (declared: 'loss')"),
        ({"loss": torch.ones(3)}, "a tensor of shape (3,); log a scalar"),
        ({"loss": "low"}, "expected a number or a 1-element tensor"),
    ],
)
def test_bad_log_calls_name_the_value(values: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as error:
        StepMetrics(("loss",), 2).log(0, values)
    assert words in str(error.value)


def test_metrics_must_be_declared_as_names() -> None:
    net = nn.Linear(5, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"metrics='loss' must be a sequence of names"):
        keepstep.init(net, opt, dataset(), GB, MB, SEED, env={}, metrics="loss")
    with pytest.raises(ConfigError, match="names one metric twice"):
        keepstep.init(net, opt, dataset(), GB, MB, SEED, env={}, metrics=("a", "a"))
    with pytest.raises(ConfigError, match="prefetch=-2 must be an integer >= 0"):
        keepstep.init(net, opt, dataset(), GB, MB, SEED, env={}, prefetch=-2)
    job = keepstep.init(net, opt, dataset(), GB, MB, SEED, env={})
    step = next(job.steps(1))
    mb = next(step.micro_batches())
    with pytest.raises(ConfigError, match=r"the job declares no metrics; pass metrics=\('loss',\)"):
        step.log(loss=F.mse_loss(net(mb.inputs), mb.targets))


def test_a_peer_lost_in_the_metrics_sum_leaves_the_step_untouched() -> None:
    """The gradient's sum succeeded here, the metrics' sum did not (the peer died between
    them): nothing may have moved, or the repeated step would differ from a member whose
    gradient sum failed. Neither the reducer's exponents nor any `.grad`."""
    from keepstep.elastic.errors import PeerLost
    from keepstep.elastic.step import StepOutcome

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    job = keepstep.init(net, opt, dataset(), GB, MB, SEED, env={}, metrics=("loss",))
    steps = job.steps(3)
    step = next(steps)  # step 0 commits normally: the exponents have moved once
    for mb in step.micro_batches():
        loss = F.mse_loss(net(mb.inputs), mb.targets)
        step.log(loss=loss)
        step.backward(loss)
    assert step.commit()
    step = next(steps)
    before = {k: v.clone() for k, v in job.reducer.state_dict().items()}
    params = [p.detach().clone() for p in net.parameters()]
    assert job.comm is not None
    real, calls = job.comm.allreduce, []

    def second_call_fails(tensor: torch.Tensor, *args: Any) -> None:
        calls.append(tensor.numel())
        if len(calls) == 2:
            raise PeerLost(0, "the peer died between the two sums")
        real(tensor, *args)

    job.comm.allreduce = second_call_fails  # type: ignore[method-assign]
    for mb in step.micro_batches():
        loss = F.mse_loss(net(mb.inputs), mb.targets)
        step.log(loss=loss)
        step.backward(loss)
    result = step.commit()
    assert result.outcome is StepOutcome.FAILED and len(calls) == 2
    after = job.reducer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters(), strict=True))
    job.comm.allreduce = real  # type: ignore[method-assign]
    steps.close()
    job.snapshots.close()
