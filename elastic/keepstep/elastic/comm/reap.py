"""Dropping the gloo group of a given-up or closed epoch, off the caller's thread, and
never under a finalizing interpreter; and, at exit, the live groups with no work left.

Where it sits: below communicator.py, which hands every group it retires to the process's
`Reaper` (owned by `ExitGuard`, exit_guard.py); the guard closes the reaper at exit.

A group's destructor joins gloo's threads, and with a collective still running (a dead
peer's) it can block until that collective times out, so it runs on a daemon thread. A
daemon thread that comes back from C++ after the interpreter began to finalize is ended
with a forced unwind, and one through a destructor kills the process with SIGABRT
("terminate called without an active exception"), after its work was done. So at exit:
reapers already dropping, or about to, are waited for (bounded); any other reaper keeps its
group and never drops it, and the process ends with the group alive.

A live group (the last epoch's, which a script need not close) is dropped at exit too, on
the exiting thread, if its links say no work of theirs is in flight (``track``,
``drop_idle``). gloo's worker thread destroys each finished work after the caller saw it
complete, and with it the last reference to the work's tensors when the caller dropped
them: their Python objects are freed there, under the GIL. A process that exits right
after its last collective can reach that point while the interpreter finalizes, and the
worker dies in a forced unwind: SIGABRT, in 3 of 40 runs of two ranks that exit right
after their last allgather. The group's destructor (run without the GIL) joins its worker
threads, so once it is dropped at exit no such thread is left (0 of 119 runs).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Protocol

_POLL_S = 0.05


class Idle(Protocol):
    """A live group's link, which can tell whether work of its own is in flight."""

    def drop_if_idle(self) -> bool:
        """Drop the group now, on this thread, if no work of it is in flight; say so."""
        ...


class Reaper:
    """Drops retired groups on daemon threads until ``close``; after it, keeps them.

    Lifetime: as long as the groups it was handed may still be dropped. The process's one
    reaper belongs to the exit guard, which closes it when the interpreter exits; a test
    makes its own and closes it to see what exit does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropping: set[threading.Thread] = set()  # dropping a group now, or about to
        self._closed = False
        self._live: weakref.WeakSet[Idle] = weakref.WeakSet()  # links of live groups
        self._kept: set[Idle] = set()  # links kept alive until exit or ``forget``

    def reap(self, epoch: int, group: Any, work: Any | None, bound_s: float) -> None:
        """Drop ``group`` on a daemon thread once ``work`` is over or ``bound_s`` passed.

        It polls with a Python sleep rather than blocking in gloo, so at exit the thread is
        frozen in the interpreter instead of waking inside C++.
        """
        box = [group, work]

        def run() -> None:
            deadline = time.monotonic() + bound_s
            while box[1] is not None and not box[1].is_completed() and time.monotonic() < deadline:
                time.sleep(_POLL_S)
            me = threading.current_thread()
            with self._lock:
                keep = self._closed and me not in self._dropping
                if not keep:
                    self._dropping.add(me)
            if keep:
                hold()
            try:
                box.clear()  # the last references: the group's destructor joins its threads
            finally:
                with self._lock:
                    self._dropping.discard(me)

        def hold() -> None:
            # Too late to drop anything safely: the group stays referenced from this frame,
            # and the thread waits for the process to end.
            keep_alive = box
            threading.Event().wait()
            del keep_alive

        with self._lock:
            late = self._closed
            thread = threading.Thread(
                target=hold if late else run, name=f"keepstep-reap-{epoch}", daemon=True
            )
            if not late and (work is None or work.is_completed()):
                self._dropping.add(thread)  # drops at once: counted before it even starts
        thread.start()

    def close(self, wait_s: float) -> None:
        """Drop nothing more; wait up to ``wait_s`` for the reapers already dropping."""
        with self._lock:
            self._closed = True
            busy = list(self._dropping)
        deadline = time.monotonic() + wait_s
        for thread in busy:
            while thread.ident is None and time.monotonic() < deadline:
                time.sleep(0.001)  # registered by `reap` a moment before its start
            if thread.ident is not None:
                thread.join(max(deadline - time.monotonic(), 0.0))

    def track(self, link: Idle, keep: bool = False) -> None:
        """``link``'s group is live: ``drop_idle`` drops it at exit if it is idle then (a
        link it retires meanwhile says it has no group). With ``keep`` the link is held
        until then, or until ``forget``: its group must be ended in order even if the
        script dropped its communicator (an NCCL group, which is shut down)."""
        with self._lock:
            self._live.add(link)
            if keep:
                self._kept.add(link)

    def forget(self, link: Idle) -> None:
        """``link`` let its group go: it is no longer held for exit."""
        with self._lock:
            self._kept.discard(link)
            self._live.discard(link)

    def drop_idle(self) -> int:
        """At exit, after ``close``: drop every tracked group with no work in flight, on
        this thread; return how many. One with work in flight (a wait the script left,
        say) is kept: its destructor would wait for that work's timeout."""
        with self._lock:
            links = list(self._live)
            self._live.clear()
            self._kept.clear()  # ``links`` holds them while they are dropped
        return sum(link.drop_if_idle() for link in links)
