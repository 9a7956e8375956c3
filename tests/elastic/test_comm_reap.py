"""Reaping retired gloo groups: dropped promptly in a running process, never once the
process is exiting (a drop then can kill the process with SIGABRT)."""

from __future__ import annotations

import threading
import time
import weakref

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
