"""Tests of the NCCL transport that need no GPU: its pure decisions (nccl_policy.py), the
options and handle exchange of nccl_group.py, and nccl.py's link over a fake NCCL group
(abort from another thread, buffers held until their work ends, the wedged-worker exit,
one live communicator per process). The link at the end of its group's life (exit) is in
test_transport_nccl_exit.py; the real path is in test_transport_nccl_gpu.py."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, Store

from keepstep.elastic.comm import Communicator, abort_epoch, abort_key
from keepstep.elastic.comm.group import EpochSpec
from keepstep.elastic.comm.nccl import NcclLink, NcclTransport, OneLive
from keepstep.elastic.comm.nccl_group import apply_options, exchange_handles
from keepstep.elastic.comm.nccl_policy import (
    ENV_FOR_ABORT,
    WEDGED_EXIT_CODE,
    AfterAbort,
    Claim,
    Flavour,
    Holder,
    NcclSettings,
    after_abort,
    choose_flavour,
    decide_claim,
    env_changes,
    plan_options,
)
from keepstep.elastic.comm.reap import Reaper
from keepstep.elastic.errors import ConfigError, PeerLost

_WAIT_S = 10.0  # bound of every wait here; none is expected to take long
_CUDA0 = torch.device("cuda", 0)

# ---- pure decisions -------------------------------------------------------------------------


def test_the_flavour_is_nccl2_where_torch_has_it_unless_switched_off() -> None:
    assert choose_flavour(True, True, {}) == (
        Flavour.NCCL2,
        "ProcessGroupNCCL2 is present: abort revokes work in flight",
    )
    flavour, why = choose_flavour(True, True, {"TORCH_DIST_USE_NCCL2": "0"})
    assert (flavour, why) == (
        Flavour.LEGACY,
        "TORCH_DIST_USE_NCCL2=0 asks for the legacy ProcessGroupNCCL",
    )
    flavour, why = choose_flavour(False, True, {"TORCH_DIST_USE_NCCL2": "1"})
    assert flavour is Flavour.LEGACY and "has no ProcessGroupNCCL2" in why
    with pytest.raises(ConfigError, match="no NCCL process group"):
        choose_flavour(False, False, {})


def test_env_changes_are_only_what_differs() -> None:
    assert env_changes(dict(ENV_FOR_ABORT)) == {}
    changes = env_changes({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "0"})
    assert changes == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"abort_deadline": timedelta(0)}, "abort_deadline must be a positive timedelta"),
        ({"abort_deadline": 5}, "abort_deadline must be a positive timedelta, got 5"),
        ({"poll_s": 0}, "poll_s must be a number of seconds in (0, 0.1], got 0"),
        ({"poll_s": True}, "got True"),
        ({"high_priority_stream": 1}, "high_priority_stream must be a bool, got 1"),
    ],
)
def test_settings_name_the_bad_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        NcclSettings(**kwargs)


def test_options_are_non_blocking_and_reconfigurable_for_nccl2() -> None:
    settings = NcclSettings(high_priority_stream=True)
    nccl2 = plan_options(Flavour.NCCL2, timedelta(seconds=7), settings)
    legacy = plan_options(Flavour.LEGACY, timedelta(seconds=7), settings)
    assert (nccl2.blocking, nccl2.enable_reconfigure, nccl2.high_priority_stream) == (0, True, True)
    assert (legacy.blocking, legacy.enable_reconfigure) == (0, False)
    # torch's own options class (it exists in a CPU process too). A torch without NCCL2
    # (2.11, say) has no enable_reconfigure field and is never planned the NCCL2 options.
    if hasattr(dist, "ProcessGroupNCCL2"):
        opts = dist.ProcessGroupNCCL.Options()
        apply_options(opts, nccl2)
        assert (opts._timeout, opts.config.blocking, opts.enable_reconfigure) == (
            timedelta(seconds=7),
            0,
            True,
        )
    opts = dist.ProcessGroupNCCL.Options()
    apply_options(opts, legacy)
    assert (opts._timeout, opts.config.blocking) == (timedelta(seconds=7), 0)
    assert getattr(opts, "enable_reconfigure", False) is False
    # An older torch without config: the environment carries the setting.
    old = SimpleNamespace(_timeout=None)
    apply_options(old, legacy)
    assert old._timeout == timedelta(seconds=7)


def test_one_live_communicator_per_process_is_decided_from_the_holder() -> None:
    assert decide_claim(None, 3)[0] is Claim.TAKE
    action, why = decide_claim(Holder(2, retiring=True), 3)
    assert (action, why) == (Claim.WAIT, "epoch 2's NCCL communicator is still being aborted")
    action, why = decide_claim(Holder(2, retiring=False), 3)
    assert action is Claim.REFUSE
    assert "still live in this process; close its communicator before building epoch 3's" in why


def test_after_an_abort_wait_release_or_exit_at_the_deadline() -> None:
    deadline = timedelta(seconds=5)
    assert after_abort(10.0, 8.0, True, True, deadline, 1)[0] is AfterAbort.RELEASE
    assert after_abort(12.9, 8.0, False, True, deadline, 1)[0] is AfterAbort.WAIT
    assert after_abort(12.9, 8.0, True, False, deadline, 1)[0] is AfterAbort.WAIT
    action, why = after_abort(13.0, 8.0, False, False, deadline, 1)
    assert action is AfterAbort.EXIT
    assert "did not let go within 5 s of its abort (abort() has not returned)" in why
    assert f"exiting with status {WEDGED_EXIT_CODE}" in why
    action, why = after_abort(20.0, 8.0, True, False, deadline, 1)
    assert action is AfterAbort.EXIT and "(its work has not ended)" in why


def test_the_slot_takes_refuses_and_waits_for_an_aborting_holder() -> None:
    slot = OneLive()
    slot.claim(1, 0.0)
    with pytest.raises(ConfigError, match="epoch 1's NCCL communicator is still live"):
        slot.claim(2, _WAIT_S)
    slot.retiring(1)
    with pytest.raises(RuntimeError, match="still being aborted after 0 s"):
        slot.claim(2, 0.0)
    releaser = threading.Timer(0.05, slot.release, args=(1,))
    releaser.start()
    slot.claim(2, _WAIT_S)  # waits for the release, then takes it
    releaser.join(_WAIT_S)
    assert slot.holder == Holder(2, retiring=False)
    slot.release(1)  # a stale release changes nothing
    assert slot.holder == Holder(2, retiring=False)


def test_handles_are_exchanged_in_rank_order_through_the_store() -> None:
    store = HashStore()
    members = ("a", "b", "c")
    got: dict[str, list[str]] = {}

    def run(me: str) -> None:
        spec = EpochSpec(0, members, me, timedelta(seconds=_WAIT_S), "127.0.0.1")
        got[me] = exchange_handles(store, spec, f"handle-of-{me}")

    threads = [threading.Thread(target=run, args=(me,)) for me in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(_WAIT_S)
    expected = ["handle-of-a", "handle-of-b", "handle-of-c"]
    assert got == {me: expected for me in members}


# ---- the link over a fake NCCL group --------------------------------------------------------


class _Work:
    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor
        self.done = threading.Event()
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self.done.set()


class _Group:
    """A fake NCCL group: work runs until finished; ``abort`` ends it (NCCL2 revokes)
    unless ``revokes`` is off, and blocks while ``abort_blocks`` is set."""

    def __init__(self, revokes: bool = True) -> None:
        self.revokes = revokes
        self.works: list[_Work] = []
        self.aborts: list[str] = []
        self.shutdowns: list[str] = []
        self.abort_blocks = threading.Event()
        self.abort_may_return = threading.Event()
        self.shutdown_blocks = threading.Event()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        work = _Work(tensors[0])
        self.works.append(work)
        return work

    def shutdown(self) -> None:
        self.shutdowns.append(threading.current_thread().name)
        if self.shutdown_blocks.is_set():
            self.abort_may_return.wait(_WAIT_S)

    def abort(self) -> None:
        self.aborts.append(threading.current_thread().name)
        if self.abort_blocks.is_set():
            self.abort_may_return.wait(_WAIT_S)
        if self.revokes:
            for work in self.works:
                if not work.is_completed():
                    work.finish("NCCL communicator was aborted")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _link(
    group: _Group,
    slot: OneLive,
    reaper: Reaper | None = None,
    deadline: timedelta = timedelta(seconds=5),
    **kwargs: Any,
) -> NcclLink:
    slot.claim(4, 0.0)
    return NcclLink(
        group,
        4,
        _CUDA0,
        slot=slot,
        settings=NcclSettings(abort_deadline=deadline),
        reaper=reaper if reaper is not None else Reaper(),
        **kwargs,
    )


def test_a_collective_is_polled_in_slices_and_reports_its_error() -> None:
    group = _Group()
    link = _link(group, OneLive())
    tensor = torch.zeros(3)
    pending = link.allreduce(tensor, dist.ReduceOp.SUM, timedelta(seconds=1))
    assert not pending.ready(1) and not pending.is_completed()
    group.works[0].finish()
    assert pending.ready(1)
    pending.result()
    second = link.allreduce(tensor, dist.ReduceOp.SUM, timedelta(seconds=1))
    group.works[1].finish("unhandled cuda error")
    assert second.ready(1)
    with pytest.raises(RuntimeError, match="unhandled cuda error"):
        second.result()
    assert link.held == 1  # the finished first one was let go at the second's start


def test_interrupt_aborts_once_off_the_callers_thread_then_releases() -> None:
    group, slot = _Group(), OneLive()
    link = _link(group, slot)
    pending = link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))
    link.interrupt()
    link.interrupt()
    assert link.released.wait(_WAIT_S)
    assert len(group.aborts) == 1 and group.aborts[0] == "keepstep-nccl-4-abort"
    assert pending.ready(1)
    with pytest.raises(RuntimeError, match="aborted"):
        pending.result()
    assert slot.holder is None and link.raw is None and link.held == 0
    with pytest.raises(RuntimeError, match="epoch 4's NCCL communicator was aborted"):
        link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))


def test_buffers_are_held_until_their_work_ends_after_the_abort() -> None:
    group, slot = _Group(revokes=False), OneLive()
    link = _link(group, slot)
    buffer = torch.zeros(2)
    pending = link.allreduce(buffer, dist.ReduceOp.SUM, timedelta(seconds=1))
    link.retire(pending)
    assert link.abort_returned.wait(_WAIT_S)
    assert not link.released.is_set()  # aborted, but its work may still write the buffer
    assert link.held == 1 and slot.holder == Holder(4, retiring=True)
    group.works[0].finish()
    assert link.released.wait(_WAIT_S)
    assert link.held == 0 and slot.holder is None


def test_a_communicator_that_does_not_let_go_ends_the_worker() -> None:
    group, slot, clock = _Group(), OneLive(), _Clock()
    group.abort_blocks.set()
    wedged: list[str] = []
    exited = threading.Event()

    def on_wedged(reason: str) -> None:
        wedged.append(reason)
        exited.set()

    link = _link(group, slot, on_wedged=on_wedged, clock=clock)
    link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))
    link.interrupt()
    clock.now += 4.9
    assert not exited.wait(0.1)  # within the deadline: still waiting
    clock.now += 0.2
    assert exited.wait(_WAIT_S)
    group.abort_may_return.set()
    assert wedged and "(abort() has not returned)" in wedged[0]
    assert f"exiting with status {WEDGED_EXIT_CODE}" in wedged[0]
    assert slot.holder == Holder(4, retiring=True)  # never released: the process ends


# ---- the transport over a fake builder -------------------------------------------------------


def _transport(slot: OneLive, groups: list[_Group], fail: bool = False) -> NcclTransport:
    def build(store: Store, spec: EpochSpec, device: torch.device, s: NcclSettings) -> _Group:
        if fail:
            raise RuntimeError("ncclUnhandledCudaError")
        groups.append(_Group())
        return groups[-1]

    return NcclTransport(_CUDA0, Reaper(), slot=slot, build=build)


def test_the_transport_takes_cuda_tensors_of_its_device_only() -> None:
    transport = _transport(OneLive(), [])
    assert transport.device == _CUDA0
    with pytest.raises(
        ConfigError,
        match=re.escape("allreduce needs a dense cuda:0 tensor, got torch.strided on cpu"),
    ):
        transport.check_tensor(torch.zeros(1), "allreduce")
    with pytest.raises(ConfigError, match="the NCCL transport needs a cuda device"):
        NcclTransport(torch.device("cpu"), Reaper())


def test_the_next_epoch_connects_only_once_the_last_one_is_aborted() -> None:
    slot, groups = OneLive(), list[_Group]()
    transport = _transport(slot, groups)

    def spec(epoch: int) -> EpochSpec:
        return EpochSpec(epoch, ("a", "b"), "a", timedelta(seconds=_WAIT_S), "127.0.0.1")

    first = transport.connect(HashStore(), spec(0))
    with pytest.raises(ConfigError, match="close its communicator before building epoch 1's"):
        transport.connect(HashStore(), spec(1))
    first.retire(None)
    second = transport.connect(HashStore(), spec(1))  # waits for the abort to finish
    assert first.released.is_set() and len(groups[0].aborts) == 1
    assert slot.holder == Holder(1, retiring=False)
    second.retire(None)
    assert second.released.wait(_WAIT_S)
    failing = _transport(slot, [], fail=True)
    with pytest.raises(RuntimeError, match="ncclUnhandledCudaError"):
        failing.connect(HashStore(), spec(2))
    assert slot.holder is None  # a failed build frees the slot


def test_the_listener_aborts_the_nccl_communicator_of_an_aborted_epoch() -> None:
    store, slot, groups = HashStore(), OneLive(), list[_Group]()
    comm = Communicator.over(_transport(slot, groups), store, 6, ["a", "b"], "a")
    (group,) = groups
    abort_epoch(store, 6, "agent: b lost its lease", 2)
    assert comm.aborted()
    assert _until(lambda: slot.holder is None)  # aborted and released by the listener
    assert len(group.aborts) == 1 and group.aborts[0] == "keepstep-nccl-6-abort"
    with pytest.raises(PeerLost, match="b lost its lease"):
        comm.barrier()
    comm.close()


def test_a_communicator_never_closed_refuses_the_next_epoch_and_aborts_it() -> None:
    store, slot, groups = HashStore(), OneLive(), list[_Group]()
    transport = _transport(slot, groups)
    first = Communicator.over(transport, store, 0, ["a", "b"], "a")
    with pytest.raises(ConfigError, match="close its communicator before building epoch 1's"):
        Communicator.over(transport, store, 1, ["a", "b"], "a")
    assert store.check([abort_key(1)])  # the other members give epoch 1 up at once
    first.close()
    assert _until(lambda: slot.holder is None)


def _until(done: Callable[[], bool]) -> bool:
    pause = threading.Event()
    for _ in range(int(_WAIT_S / 0.01)):
        if done():
            return True
        pause.wait(0.01)
    return done()


def test_keepstep_imports_on_a_torch_without_nccl2() -> None:
    # torch before 2.15 (the GPU machine's 2.11) has no ReconfigureOptions and no
    # ProcessGroupNCCL2: the communicator still imports, picks the legacy group for CUDA,
    # and runs gloo. Simulated in a fresh interpreter by removing both names first (on such
    # a torch, there is nothing to remove).
    code = (
        "import torch._C._distributed_c10d as c, torch.distributed as dist\n"
        "if hasattr(c, 'ReconfigureOptions'): del c.ReconfigureOptions\n"
        "if hasattr(dist, 'ProcessGroupNCCL2'): delattr(dist, 'ProcessGroupNCCL2')\n"
        "from keepstep.elastic.comm import Communicator\n"
        "from keepstep.elastic.comm.nccl_group import observed_flavour\n"
        "print(observed_flavour({})[0].value if dist.is_nccl_available() else 'none')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() in ("legacy", "none"), proc.stdout
