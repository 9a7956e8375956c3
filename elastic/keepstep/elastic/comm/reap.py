"""Dropping the gloo group of a given-up or closed epoch, off the caller's thread, and
never under a finalizing interpreter.

Where it sits: below communicator.py, which hands every group it retires to the process's
`Reaper` (owned by `ExitGuard`, exit_guard.py); the guard closes the reaper at exit.

A group's destructor joins gloo's threads, and with a collective still running (a dead
peer's) it can block until that collective times out, so it runs on a daemon thread. A
daemon thread that comes back from C++ after the interpreter began to finalize is ended
with a forced unwind, and one through a destructor kills the process with SIGABRT
("terminate called without an active exception"), after its work was done. So at exit:
reapers already dropping, or about to, are waited for (bounded); any other reaper keeps its
group and never drops it, and the process ends with the group alive.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_POLL_S = 0.05


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
