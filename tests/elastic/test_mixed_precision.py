"""Mixed precision in the exact mode: bfloat16 autocast, and float16 loss scaling with a
GradScaler that keepstep drives (`keepstep.init(grad_scaler=...)`).

Members run on threads of this process over one HashStore (as test_comm.py's two-rank
tests do): each builds its model, optimizer and scaler the same way, and the runs with 1, 2
and 3 members must end with the same bits, the scaler's state included, and skip the same
steps. The skip pattern and the scale are also checked against torch's own recipe
(`scaler.scale(loss).backward(); scaler.unscale_(opt); scaler.step(opt); scaler.update()`)
in one plain process on the same samples. The slow test trains examples/scheduled.py with
`--amp` in real processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import ConfigError, Job, NonFiniteGradient, ScheduleController
from keepstep.elastic.rng import SampleOrder
from keepstep.launch.local import LocalRun, agreed_sha, run_local

REPO = Path(__file__).resolve().parents[2]

GB, MB, SEED, STEPS = 16, 4, 7, 14
N_MICRO = GB // MB
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 6, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, 6).unsqueeze(1) + 0.1 * torch.randn(96, 1, generator=g)
    return TensorDataset(x, y)


def model() -> nn.Sequential:
    torch.manual_seed(0)  # called from the main thread only: the global generator is shared
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))


def scaler(**kw: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kw)


def loss_of(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, amp: str | None) -> Any:
    if amp is None:
        return F.mse_loss(net(inputs), targets)
    with torch.autocast("cpu", dtype=AMP[amp]):
        return F.mse_loss(net(inputs), targets)


@dataclass
class Member:
    """One member's script: its job, and what its loop saw."""

    job: Job
    net: nn.Module
    scaler: torch.amp.GradScaler | None
    amp: str | None
    skipped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    error: BaseException | None = None

    def train(self, steps: int) -> None:
        try:
            for step in self.job.steps(steps):
                for mb in step.micro_batches():
                    loss = loss_of(self.net, mb.inputs, mb.targets, self.amp)
                    step.backward(self.scaler.scale(loss) if self.scaler is not None else loss)
                result = step.commit()
                if result:
                    self.skipped.append(result.skipped)
                    if self.scaler is not None:
                        self.scales.append(self.scaler.get_scale())
            self.job.snapshots.close()
        except BaseException as error:  # re-raised by the test thread
            self.error = error

    def outcome(self) -> dict[str, Any]:
        return {
            "skipped": self.skipped,
            "scales": self.scales,
            "params": self.job.params_sha256(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }


def run(
    n: int, amp: str | None = None, steps: int = STEPS, shard: str | None = None, **scaler_kw: Any
) -> dict[str, Any]:
    """Train with `n` members on threads; every member's outcome must be the same: return it.
    Without `scaler_kw` there is no grad_scaler; `shard` shards the optimizer state."""
    store, names = HashStore(), [f"m{i}" for i in range(n)]
    members = []
    for me in names:  # built here, in one thread: model init draws from the global generator
        net = model()
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        gs = scaler(**scaler_kw) if scaler_kw else None
        controller = ScheduleController(store_=store, me=me, schedule=[names])
        job = keepstep.init(
            net,
            opt,
            dataset(),
            GB,
            MB,
            SEED,
            env={},
            controller=controller,
            grad_scaler=gs,
            shard=shard,
        )
        members.append(Member(job, net, gs, amp))
    threads = [threading.Thread(target=m.train, args=(steps,), daemon=True) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for m in members:
        if m.error is not None:
            raise m.error
    outcomes = [m.outcome() for m in members]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert len(outcomes[0]["skipped"]) == steps
    return outcomes[0]


def torch_recipe(amp: str | None, steps: int = STEPS, **scaler_kw: Any) -> dict[str, Any]:
    """torch's AMP recipe with gradient accumulation, in one process, on the samples
    keepstep's steps read. Each micro-batch's scaled loss is backpropagated as keepstep's
    scripts do (so a micro-batch overflows here where it does there), and the accumulated
    gradient is divided by n_micro after unscaling, to the mean keepstep reduces."""
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    gs = scaler(**scaler_kw)
    data = dataset()
    order = SampleOrder(SEED, len(data), MB, N_MICRO, True)
    skipped, scales, overflowed = [], [], []
    for s in range(steps):
        bad = 0
        for mb in range(N_MICRO):
            inputs, targets = data[order.indices(s, mb)]
            loss = gs.scale(loss_of(net, inputs, targets, amp))
            # Which micro-batches overflow on their own (a second pass, outside the recipe).
            alone = torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
            bad += not all(bool(torch.isfinite(g).all()) for g in alone)
            loss.backward()
        overflowed.append(bad)
        gs.unscale_(opt)
        for p in net.parameters():
            assert p.grad is not None
            p.grad.div_(N_MICRO)
        before = gs.get_scale()
        gs.step(opt)
        gs.update()
        opt.zero_grad(set_to_none=True)
        skipped.append(gs.get_scale() < before)  # only a skipped step backs off
        scales.append(gs.get_scale())
    return {
        "skipped": skipped,
        "scales": scales,
        "scaler": gs.state_dict(),
        "overflowed": overflowed,
    }


def test_fp16_loss_scaling_skips_the_steps_torch_skips_at_every_member_count() -> None:
    # 2**20 overflows float16 at first: the scale backs off until steps succeed, then grows
    # every 2 good steps until it overflows again.
    kw: dict[str, Any] = {"init_scale": 2.0**20, "growth_interval": 2}
    ref = torch_recipe("fp16", **kw)
    skipped = ref["skipped"]
    assert skipped[0] and not all(skipped) and any(skipped[skipped.index(False) :])
    assert [s > 0 for s in ref["overflowed"]] == skipped
    # In some skipped step only one micro-batch overflowed: with 2 or 3 members, one whose
    # own micro-batches were all finite skipped it too.
    assert any(s == 1 for s in ref["overflowed"])
    got = {n: run(n, "fp16", **kw) for n in (1, 2, 3)}
    for outcome in got.values():
        assert outcome["skipped"] == skipped
        assert outcome["scales"] == ref["scales"]
        assert outcome["scaler"] == ref["scaler"]  # scale and growth tracker
        assert outcome["params"] == got[1]["params"]


def test_fp16_loss_scaling_with_sharded_optimizer_state_matches_full_replicas() -> None:
    # The same skips, scale and parameters as one full optimizer: a skipped step leaves the
    # shards as they were, a stepped one steps them, at 1 and 3 members.
    kw: dict[str, Any] = {"init_scale": 2.0**20, "growth_interval": 2}
    full = run(1, "fp16", **kw)
    assert any(full["skipped"]) and not all(full["skipped"])
    for n in (1, 3):
        assert run(n, "fp16", shard="zero1", **kw) == full


def test_a_huge_initial_scale_in_float32_is_skipped_alike_at_every_member_count() -> None:
    # No autocast: near 2**127 some scaled float32 gradients overflow, and those that do
    # not lie far outside the reducer's first fixed-point range (it rescales and retries).
    kw: dict[str, Any] = {"init_scale": 2.0**126, "growth_interval": 3}
    got = {n: run(n, **kw) for n in (1, 2, 3)}
    assert any(got[1]["skipped"]) and not all(got[1]["skipped"])
    assert got[1] == got[2] == got[3]


def test_bf16_autocast_is_identical_at_every_member_count() -> None:
    got = {n: run(n, "bf16") for n in (1, 2, 3)}
    assert got[1]["params"] == got[2]["params"] == got[3]["params"]
    assert not any(got[1]["skipped"])
    assert got[1]["params"] != run(1)["params"]  # autocast did change the arithmetic


def test_parameters_stay_float32_under_autocast() -> None:
    net = model()
    job = keepstep.init(net, torch.optim.SGD(net.parameters(), lr=0.1), dataset(), GB, MB, env={})
    for step in job.steps(2):
        for mb in step.micro_batches():
            step.backward(loss_of(net, mb.inputs, mb.targets, "bf16"))
        step.commit()
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    job.snapshots.close()


def script(gs: torch.amp.GradScaler | None, **kw: Any) -> tuple[Job, nn.Sequential]:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    return keepstep.init(net, opt, dataset(), GB, MB, SEED, env={}, grad_scaler=gs, **kw), net


def test_a_skipped_step_commits_without_hooks_or_clipping() -> None:
    gs = scaler(init_scale=2.0**8)
    job, net = script(gs, clip_grad_norm=1.0)
    hooked: list[int] = []
    job.before_optimizer_step(lambda _m, _o: hooked.append(job.done))
    results = []
    for step in job.steps(4):
        for mb in step.micro_batches():
            loss = loss_of(net, mb.inputs, mb.targets, None)
            if step.index == 1 and mb.id == 0:
                loss = loss * float("inf")  # one micro-batch of step 1 blows up
            step.backward(gs.scale(loss))
        before = [p.detach().clone() for p in net.parameters()]
        results.append(step.commit())
        unchanged = all(map(torch.equal, before, net.parameters()))
        assert unchanged == results[-1].skipped
    assert [r.skipped for r in results] == [False, True, False, False]
    assert [r.grad_norm is None for r in results] == [False, True, False, False]
    assert all(results) and job.done == 4
    assert hooked == [0, 2, 3]  # the hooks see only steps that update
    assert gs.state_dict()["scale"] == 2.0**7 and gs.state_dict()["_growth_tracker"] == 2
    assert all(p.grad is None for p in net.parameters())
    job.snapshots.close()


def test_without_a_grad_scaler_a_non_finite_gradient_still_raises() -> None:
    job, net = script(None)
    with pytest.raises(NonFiniteGradient, match="step 0: 1 of 4 micro-batches have inf/nan"):
        for step in job.steps(1):
            for mb in step.micro_batches():
                loss = loss_of(net, mb.inputs, mb.targets, None)
                step.backward(loss * float("inf") if mb.id == 2 else loss)
            step.commit()
    job.snapshots.close()


def test_a_restarted_worker_continues_the_scale(tmp_path: Path) -> None:
    kw = {"init_scale": 2.0**20, "growth_interval": 2}

    def train(steps: int, snapshot: str | None) -> tuple[Job, torch.amp.GradScaler]:
        gs = scaler(**kw)  # a restarted worker builds it afresh: the snapshot restores it
        job, net = script(gs, snapshot_path=snapshot)
        for step in job.steps(steps):
            for mb in step.micro_batches():
                step.backward(gs.scale(loss_of(net, mb.inputs, mb.targets, "fp16")))
            step.commit()
        job.snapshots.close()
        return job, gs

    straight, gs = train(STEPS, None)
    _, first = train(5, str(tmp_path / "shm"))
    again, gs_again = train(STEPS, str(tmp_path / "shm"))
    assert first.get_scale() != gs.get_scale()
    assert gs_again.state_dict() == gs.state_dict()
    assert again.params_sha256() == straight.params_sha256()


class NotAScaler:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("bad", [NotAScaler(), "cpu", 2.0**16])
def test_a_grad_scaler_that_is_not_one_is_named(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"grad_scaler={bad!r} is not a torch.amp.GradScaler"):
        script(bad)  # type: ignore[arg-type]


def test_a_disabled_grad_scaler_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"grad_scaler=<.*GradScaler.*> is disabled"):
        script(scaler(enabled=False))


def test_the_grad_scaler_is_tracked_once_under_its_own_name() -> None:
    gs = scaler()
    with pytest.raises(ConfigError, match="'amp' is the grad_scaler given to keepstep"):
        script(gs, state={"amp": gs})
    with pytest.raises(ConfigError, match="'grad_scaler' is taken by the grad_scaler"):
        script(scaler(), state={"grad_scaler": scaler()})
    job, _ = script(gs)
    assert job.tracked.names == ("grad_scaler",)
    with pytest.raises(ConfigError, match="'again' is the grad_scaler"):
        job.track("again", gs)
    # Without a grad_scaler= the name is the script's (the way scripts tracked one before).
    job, _ = script(None, state={"grad_scaler": scaler()})
    assert job.tracked.names == ("grad_scaler",)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_the_amp_example_ends_identical_in_one_and_three_processes(
    amp: str, tmp_path: Path
) -> None:
    # With fp16 the example's GradScaler skips steps 0, 4 and 8, each for one or two of 12
    # micro-batches: with three processes, members whose own were finite skip them too.
    shas = []
    for n in (1, 3):
        run = LocalRun(
            script=str(REPO / "examples" / "scheduled.py"),
            steps=12,
            global_batch=48,
            micro_batch=4,
            schedule=[[f"m{i}" for i in range(n)]],
            seed=5,
            script_args=("--amp", amp),
            timeout=150.0,
        )
        result = run_local(run, tmp_path / str(n))
        for member, code in result.returncodes.items():
            assert code == 0, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
        shas.append(agreed_sha(result))  # covers the parameters and the tracked grad_scaler
    assert shas[0] == shas[1]
