"""Tracked script state, clipping and the hooks before the optimizer step, in one process.

A restarted worker is a new Job over the same snapshot file: it must continue a schedule,
an EMA and a counter exactly where the first one committed them. The multi-process runs
with faults are in test_tracked_consistency.py.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import (
    ConfigError,
    Job,
    JobConfig,
    ScheduleController,
    ScriptStateWarning,
    StateShapeError,
    plain_json,
)
from keepstep.elastic.errors import PeerLost, SnapshotCorrupt
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore
from keepstep.elastic.tracked import TrackedState
from keepstep.elastic.train_state import capture, restore

GB, MB = 16, 4


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.history: tuple[int, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.history = state["n"], state["history"]


class Script:
    """The parts of a training script, built the same way in every 'process'."""

    def __init__(self, *, track: bool = True, snapshot: Path | None = None, **kw: Any) -> None:
        g = torch.Generator().manual_seed(11)
        x = torch.randn(128, 6, generator=g)
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.sched = LambdaLR(self.opt, lambda i: 1.0 / (1 + i))
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
        self.counter = Counter()
        state = {"sched": self.sched, "ema": self.ema, "counter": self.counter} if track else None
        self.job = keepstep.init(
            self.model,
            self.opt,
            data,
            GB,
            MB,
            seed=1,
            env={},
            state=state,
            snapshot_path=str(snapshot) if snapshot else None,
            **kw,
        )

    def train(self, steps: int) -> Script:
        for step in self.job.steps(steps):
            for mb in step.micro_batches():
                step.backward(F.mse_loss(self.model(mb.inputs), mb.targets))
            if step.commit():
                self.advance(step.index)
        self.job.snapshots.close()
        return self

    def advance(self, index: int) -> None:
        self.sched.step()
        self.ema.update_parameters(self.model)
        self.counter.n += 1
        self.counter.history += (index,)


def test_a_restarted_worker_continues_the_tracked_state(tmp_path: Path) -> None:
    straight = Script().train(8)
    first = Script(snapshot=tmp_path / "shm").train(5)
    # The replacement process builds everything afresh: the schedule at its start, the
    # EMA equal to the initial weights, the counter at zero, and resumes from the file.
    again = Script(snapshot=tmp_path / "shm").train(8)
    assert first.counter.n == 5 and again.counter.n == 8
    assert again.counter.history == tuple(range(8))
    assert again.sched.last_epoch == straight.sched.last_epoch == 8
    for name in ("sched", "ema", "counter"):
        assert again.job.state_sha256(name) == straight.job.state_sha256(name), name
    assert again.job.params_sha256() == straight.job.params_sha256()


def test_without_tracking_a_restart_diverges_and_is_warned(tmp_path: Path) -> None:
    # The control for the test above: the lr is in the snapshot, the scheduler is not, so
    # the replacement restarts its schedule from zero and trains with another lr.
    straight = Script().train(8)
    with pytest.warns(ScriptStateWarning):
        Script(track=False, snapshot=tmp_path / "shm").train(5)
    with pytest.warns(ScriptStateWarning):
        again = Script(track=False, snapshot=tmp_path / "shm").train(8)
    assert again.sched.last_epoch == 3  # stepped 3 times in the second process only
    assert again.job.params_sha256() != _model_sha(straight.model)


def _model_sha(model: nn.Module) -> str:
    import hashlib

    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        digest.update(key.encode())
        digest.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def test_the_hash_covers_tracked_state_and_is_unchanged_without_it() -> None:
    plain = Script(track=False)
    assert plain.job.params_sha256() == _model_sha(plain.model)
    tracked = Script()
    before = tracked.job.params_sha256()
    assert before != _model_sha(tracked.model)
    tracked.counter.n = 1
    assert tracked.job.params_sha256() != before
    assert tracked.job.state_sha256("counter") != Script().job.state_sha256("counter")
    with pytest.raises(ConfigError, match=r"no tracked state named 'nope'"):
        tracked.job.state_sha256("nope")


def test_an_untracked_lr_change_is_warned_once_naming_the_group() -> None:
    script = Script(track=False)
    with pytest.warns(ScriptStateWarning) as caught:
        script.train(4)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "step 1: the lr of optimizer param group 0 changed from 0.05 to 0.025" in message
    assert "job.track('sched', sched)" in message
    assert caught[0].filename == __file__  # points at the script's step.commit()


def fail_step_3(script: Script, advance_always: bool) -> Script:
    """Train 6 steps, losing (in effect) a peer at step 3's all-reduce once."""
    controller = ScheduleController(
        store_=torch.distributed.HashStore(), me="m0", schedule=[["m0"], ["m0"]], at_step=[0, None]
    )
    script.job.controller = controller
    for step in script.job.steps(6):
        comm = script.job.comm
        assert comm is not None
        if step.index == 3 and comm.epoch == 0:

            def lost(*_: object) -> None:
                raise PeerLost(0, "m1 stopped")

            comm.allreduce = lost  # type: ignore[method-assign]
        for mb in step.micro_batches():
            step.backward(F.mse_loss(script.model(mb.inputs), mb.targets))
        committed = step.commit()
        if committed or advance_always:
            script.advance(step.index)
    return script


def test_a_repeated_step_does_not_advance_tracked_state_twice() -> None:
    straight = Script().train(6)
    again = fail_step_3(Script(), advance_always=False)
    assert again.counter.n == 6 and again.job.params_sha256() == straight.job.params_sha256()


def test_advancing_tracked_state_in_a_failed_step_is_warned() -> None:
    with pytest.warns(ScriptStateWarning, match=r"step 3 did not commit \(failed\)") as caught:
        script = fail_step_3(Script(), advance_always=True)
    assert "['sched', 'ema', 'counter']" in str(caught[0].message)
    assert caught[0].filename == __file__
    assert script.counter.n == 7  # the mistake itself: the failed step counted too


def test_tracking_the_scheduler_silences_the_warning() -> None:
    Script().train(4)  # warnings are errors in this suite


class Bad:
    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"inner": [1, {"x": self.value}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["inner"][1]["x"]


def test_registration_names_what_is_wrong() -> None:
    script = Script(track=False)
    job = script.job
    with pytest.raises(ConfigError, match=r"name 'a/b': must be 1-64 letters"):
        job.track("a/b", Counter())
    with pytest.raises(ConfigError, match=r"'thing' is a object, which lacks state_dict"):
        job.track("thing", object())  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=re.escape("tracked state 'bad'['inner'][1]['x'] is a dtype")
    ):
        job.track("bad", Bad(torch.float32))
    job.track("c", Counter())
    with pytest.raises(ConfigError, match="'c' is already registered"):
        job.track("c", Counter())
    script.train(1)
    with pytest.raises(ConfigError, match=r"after job.steps\(\) began"):
        job.track("late", Counter())
    with pytest.raises(ConfigError, match="must map names"):
        keepstep.init(script.model, script.opt, [0] * 16, GB, MB, env={}, state=[Counter()])  # type: ignore[arg-type]


class Nested:
    def __init__(self, scale: float) -> None:
        self.state: dict[str, Any] = {
            "od": collections.OrderedDict(w=torch.full((2, 3), scale), n=torch.tensor(7)),
            "tup": (1, 2.5, None, b"x", 1 + 2j),
            "set": {"a", "b"},
            "frozen": frozenset({3}),
            "deep": [[{"t": torch.arange(4) * scale}]],
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_nested_state_round_trips_through_an_exported_slot() -> None:
    # An exported slot is what a joiner receives and what a durable checkpoint holds.
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved, loaded = TrackedState(), TrackedState()
    saved.add("nested", Nested(2.0))
    target = Nested(0.0)
    loaded.add("nested", target)
    store = SnapshotStore(MemoryBuffer(), background=False)
    state = capture(1, model, opt, tracked=saved)
    assert {k for k in state.tensors if k.startswith("tracked/")} == {
        f"tracked/nested/{i}" for i in range(3)
    }
    store.commit(1, state.tensors, state.meta)
    elsewhere = SnapshotStore(MemoryBuffer(), background=False)
    elsewhere.import_(store.export(1))
    restore(elsewhere.load(1), model, opt, loaded)
    got = target.state
    assert torch.equal(got["od"]["w"], torch.full((2, 3), 2.0)) and int(got["od"]["n"]) == 7
    assert got["tup"] == (1, 2.5, None, b"x", 1 + 2j) and isinstance(got["tup"], tuple)
    assert got["set"] == {"a", "b"} and got["frozen"] == frozenset({3})
    assert torch.equal(got["deep"][0][0]["t"], torch.arange(4) * 2.0)
    assert loaded.sha256() == saved.sha256()
    # A tool that wants the parameters only reads past the tracked state.
    restore(elsewhere.load(1), model, opt)


def test_a_snapshot_of_other_tracked_names_is_refused_before_anything_changes() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = TrackedState()
    saved.add("counter", Counter())
    snap = capture(0, model, opt, tracked=saved)
    other = nn.Linear(2, 1)
    before = [p.clone() for p in other.parameters()]
    mine = TrackedState()
    mine.add("sched", Counter())
    with pytest.raises(StateShapeError, match=r"the job tracks \['sched'\], the snapshot holds"):
        restore(snap, other, torch.optim.SGD(other.parameters(), lr=0.1), mine)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
    with pytest.raises(
        StateShapeError, match=r"the job tracks \['sched'\], the snapshot holds \[\]"
    ):
        restore(capture(0, model, opt), other, torch.optim.SGD(other.parameters(), lr=0.1), mine)


def test_a_malformed_tracked_tree_is_corrupt_not_loaded() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = TrackedState()
    saved.add("counter", Counter())
    snap = capture(0, model, opt, tracked=saved)
    meta = plain_json.loads(snap.meta)
    meta["tracked"][0][1] = ("Q", 1)
    bad = type(snap)(0, snap.tensors, plain_json.dumps(meta))
    with pytest.raises(SnapshotCorrupt, match="malformed tree node 'Q'"):
        restore(bad, model, opt, saved)


def test_clipping_and_hooks_act_on_the_reduced_gradient() -> None:
    clipped = Script(track=False, clip_grad_norm=0.05)
    seen: list[float] = []

    @clipped.job.before_optimizer_step
    def record(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        assert opt is clipped.opt and model is clipped.model
        norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        seen.append(float(torch.stack(norms).norm()))

    norms: list[float | None] = []
    for step in clipped.job.steps(3):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(clipped.model(mb.inputs), mb.targets))
        result = step.commit()
        norms.append(result.grad_norm)
    # The hook ran once per committed step, before clipping: it saw the norm clipping saw.
    assert len(seen) == 3 and all(n is not None for n in norms)
    assert seen == pytest.approx(norms, rel=1e-6)
    assert all(n is not None and n > 0.05 for n in norms)  # the clip was active
    free = Script(track=False)
    for step in free.job.steps(3):
        for mb in step.micro_batches():
            step.backward(F.mse_loss(free.model(mb.inputs), mb.targets))
        assert step.commit().grad_norm is None
    assert free.job.params_sha256() != clipped.job.params_sha256()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_clip_grad_norm_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"clip_grad_norm={bad!r} must be a finite")):
        JobConfig(global_batch=8, micro_batch=4, clip_grad_norm=bad)  # type: ignore[arg-type]


def test_a_hook_must_be_callable() -> None:
    job: Job = Script(track=False).job
    with pytest.raises(ConfigError, match="not callable"):
        job.before_optimizer_step(3)  # type: ignore[arg-type]
