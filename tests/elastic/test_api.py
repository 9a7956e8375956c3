"""The training-script API in one process: the loop, its errors, and its determinism."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F
from api_model import make, train
from torch import nn
from torch._C._distributed_c10d import HashStore
from torch.utils.data import TensorDataset

import keepstep
from keepstep.elastic import (
    ConfigError,
    JobConfig,
    Membership,
    ScheduleController,
    StateShapeError,
)
from keepstep.elastic.errors import PeerLost


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
