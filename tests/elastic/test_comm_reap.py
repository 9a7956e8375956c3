"""Reaping retired gloo groups: dropped promptly in a running process, never once the
process is exiting (a drop then can kill the process with SIGABRT)."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from keepstep.elastic.comm import reap as comm_reap


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
    comm_reap.reap(0, group, None, bound_s=30.0)
    del group
    assert dropped(ref, 2.0)


def test_a_group_is_dropped_when_its_work_ends_or_the_bound_passes() -> None:
    work, group = Work(), Group()
    ref = weakref.ref(group)
    comm_reap.reap(1, group, work, bound_s=30.0)
    del group
    assert not dropped(ref, 0.2)  # the work is still running
    work.done.set()
    assert dropped(ref, 2.0)
    stuck, group = Work(), Group()
    ref = weakref.ref(group)
    comm_reap.reap(2, group, stuck, bound_s=0.1)
    del group
    assert dropped(ref, 2.0)


def test_once_exiting_no_group_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    work, waiting = Work(), Group()
    waiting_ref = weakref.ref(waiting)
    comm_reap.reap(3, waiting, work, bound_s=30.0)
    del waiting
    monkeypatch.setattr(comm_reap, "_exiting", True)
    # A reaper whose work ends after exit began keeps its group...
    work.done.set()
    assert not dropped(waiting_ref, 0.3)
    # ...and so does one handed a group after it.
    late = Group()
    late_ref = weakref.ref(late)
    comm_reap.reap(4, late, None, bound_s=0.0)
    del late
    assert not dropped(late_ref, 0.3)
