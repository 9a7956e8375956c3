"""Reaping retired gloo groups: dropped promptly in a running process, never once the
process is exiting (a drop then can kill the process with SIGABRT); and at exit, the
live groups whose work is over are dropped before the interpreter finalizes."""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from keepstep.elastic.comm.gloo import GlooLink
from keepstep.elastic.comm.reap import Reaper


class Group:
    """Stands in for a gloo group: only its lifetime matters here."""


class Work:
    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()


def dropped(ref: weakref.ref[Group], within: float) -> bool:
    deadline = time.monotonic() + within
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    return ref() is None


def test_a_group_without_pending_work_is_dropped_at_once() -> None:
    group = Group()
    ref = weakref.ref(group)
    Reaper().reap(0, group, None, bound_s=30.0)
    del group
    assert dropped(ref, 2.0)


def test_a_group_is_dropped_when_its_work_ends_or_the_bound_passes() -> None:
    reaper = Reaper()
    work, group = Work(), Group()
    ref = weakref.ref(group)
    reaper.reap(1, group, work, bound_s=30.0)
    del group
    assert not dropped(ref, 0.2)  # the work is still running
    work.done.set()
    assert dropped(ref, 2.0)
    stuck, group = Work(), Group()
    ref = weakref.ref(group)
    reaper.reap(2, group, stuck, bound_s=0.1)
    del group
    assert dropped(ref, 2.0)


def test_once_exiting_no_group_is_dropped() -> None:
    reaper = Reaper()
    work, waiting = Work(), Group()
    waiting_ref = weakref.ref(waiting)
    reaper.reap(3, waiting, work, bound_s=30.0)
    del waiting
    begun = time.monotonic()
    reaper.close(wait_s=5.0)  # what the exit guard does at interpreter exit
    assert time.monotonic() - begun < 1.0  # nothing was dropping: nothing to wait for
    # A reaper whose work ends after exit began keeps its group...
    work.done.set()
    assert not dropped(waiting_ref, 0.3)
    # ...and so does one handed a group after it.
    late = Group()
    late_ref = weakref.ref(late)
    reaper.reap(4, late, None, bound_s=0.0)
    del late
    assert not dropped(late_ref, 0.3)


class GlooLike:
    """Stands in for a gloo group whose allreduce returns a work the test completes."""

    def __init__(self) -> None:
        self.works: list[TimedWork] = []

    def allreduce(self, tensors: object, opts: object) -> TimedWork:
        self.works.append(TimedWork())
        return self.works[-1]


class TimedWork(Work):
    def wait(self, timeout: timedelta | None = None) -> bool:
        return self.done.wait(None if timeout is None else timeout.total_seconds())


def test_at_exit_a_live_group_is_dropped_once_its_work_is_seen_over() -> None:
    # The last epoch's group, which a script need not close: gloo's worker threads must be
    # joined while Python still runs, or one freeing a finished work's tensors during
    # finalization kills the process with SIGABRT.
    reaper = Reaper()
    group = GlooLike()
    ref, works = weakref.ref(group), group.works
    link = GlooLink(group, 5, reaper, bound_s=30.0)
    del group
    pending = link.allreduce(torch.zeros(2), dist.ReduceOp.SUM, timedelta(seconds=5))
    assert link.in_flight == 1
    reaper.close(wait_s=1.0)
    assert reaper.drop_idle() == 0  # its work may still run: the destructor would wait
    assert ref() is not None
    works[0].done.set()
    assert pending.ready(5)
    assert link.in_flight == 0
    reaper.track(link)  # drop_idle forgets what it looked at: track it again
    assert reaper.drop_idle() == 1
    assert ref() is None  # dropped on this thread, at once
    assert link.raw is None


def test_at_exit_a_retired_group_is_not_dropped_twice() -> None:
    reaper = Reaper()
    group = GlooLike()
    link = GlooLink(group, 6, reaper, bound_s=30.0)
    link.retire(None)  # the reaper's now
    reaper.close(wait_s=1.0)
    assert reaper.drop_idle() == 0
