"""The NCCL link at the end of its group's life, over the fake NCCL group of
test_transport_nccl.py: the abort thread lets its group go before it says so, and at exit
an idle group the script never closed is shut down in order (``NcclLink.drop_if_idle``)
while a busy or aborting one is left to its holder."""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from test_transport_nccl import _WAIT_S, _Group, _link

from keepstep.elastic.comm.nccl import NcclLink, OneLive
from keepstep.elastic.comm.reap import Reaper


class _HoldingEvent(threading.Event):
    """An event whose setter, once it set it, is held until ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.setter_held = threading.Event()
        self.go = threading.Event()

    def set(self) -> None:
        super().set()
        self.setter_held.set()
        self.go.wait(3 * _WAIT_S)  # past every wait of the test


def test_the_abort_thread_lets_the_group_go_before_it_says_it_returned() -> None:
    # Once abort() returned, the group goes to the reaper; the abort thread ends a moment
    # later and must not hold the last reference then (a group's destructor run by a
    # thread that ends as the interpreter finalizes kills the process).
    group, slot = _Group(), OneLive()
    link = _link(group, slot)
    link.abort_returned = said = _HoldingEvent()
    dropped = weakref.ref(group)
    del group
    link.interrupt()
    try:
        assert said.setter_held.wait(_WAIT_S)  # the abort thread is alive, held here
        assert link.released.wait(_WAIT_S)
        deadline = time.monotonic() + _WAIT_S
        while dropped() is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the reaper drops it on a thread of its own
        assert dropped() is None
    finally:
        said.go.set()


def _reduced(link: NcclLink, group: _Group) -> None:
    pending = link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))
    group.works[-1].finish()
    assert pending.ready(1)


def test_at_exit_an_idle_group_is_shut_down_in_order_even_if_the_script_dropped_it() -> None:
    group, slot, reaper = _Group(), OneLive(), Reaper()
    link = _link(group, slot, reaper)
    _reduced(link, group)
    released, gone = link.released, weakref.ref(group)
    del link, group  # a script need not close its last communicator
    reaper.close(0.0)
    assert reaper.drop_idle() == 1
    assert released.is_set() and slot.holder is None
    assert gone() is None  # dropped on the exiting thread, after its shutdown returned


def test_the_shutdown_at_exit_flushes_the_group_rather_than_aborting_it() -> None:
    group, slot, reaper = _Group(), OneLive(), Reaper()
    link = _link(group, slot, reaper)
    _reduced(link, group)
    reaper.close(0.0)
    assert reaper.drop_idle() == 1
    assert group.shutdowns == ["keepstep-nccl-4-shutdown"] and group.aborts == []
    assert link.raw is None


def test_at_exit_a_group_with_work_in_flight_or_aborted_is_left_to_its_holder() -> None:
    busy, reaper = _Group(), Reaper()
    link = _link(busy, OneLive(), reaper)
    link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))
    aborted = _Group(revokes=False)
    other = _link(aborted, OneLive(), reaper)
    pending = other.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=1))
    other.retire(pending)  # aborted, its work still running: the holder keeps it
    assert other.abort_returned.wait(_WAIT_S)
    reaper.close(0.0)
    assert reaper.drop_idle() == 0
    assert busy.shutdowns == [] and busy.aborts == [] and link.raw is busy
    assert aborted.shutdowns == [] and aborted.aborts == ["keepstep-nccl-4-abort"]
    aborted.works[0].finish()
    assert other.released.wait(_WAIT_S)


def test_a_released_link_is_no_longer_held_for_exit() -> None:
    group, reaper = _Group(), Reaper()
    link = _link(group, OneLive(), reaper)
    link.interrupt()
    assert link.released.wait(_WAIT_S)
    gone = weakref.ref(link)
    del link
    assert gone() is None


def test_a_shutdown_that_does_not_return_leaves_the_group_and_the_exit_goes_on() -> None:
    group, slot, reaper = _Group(), OneLive(), Reaper()
    group.shutdown_blocks.set()
    link = _link(group, slot, reaper, deadline=timedelta(seconds=0.2))
    _reduced(link, group)
    gone = weakref.ref(group)
    del group
    reaper.close(0.0)
    began = time.monotonic()
    try:
        assert reaper.drop_idle() == 0
        assert 0.2 <= time.monotonic() - began < _WAIT_S
        assert gone() is not None and not link.released.is_set()  # kept: never destroyed
    finally:
        held = gone()
        assert held is not None
        held.abort_may_return.set()
