"""The communicator's one process-wide part: what must be settled before the interpreter
finalizes.

Where it sits: beside the epochs. Everything else in comm/ belongs to one epoch and is
owned by that epoch's `Communicator`: its abort watch (two threads, each with its own
store connection) and its gloo group. Those register here only what the interpreter's exit
must stop or wait for: the watches whose listener sits in a store wait, every store call
a watch thread makes, the groups handed to the reaper, and the live groups (their
links, tracked by the reaper).

Why anything is process-wide: a thread that comes back from C++ into Python after the
interpreter began to finalize (a daemon thread, or a gloo worker freeing a finished work's
tensors) is ended with a forced unwind, which kills the process with SIGABRT ("terminate
called without an active exception") after its work was done. A script need not close its
last communicator, so only something that outlives every epoch can stop their threads in
time. For the same reason no daemon thread of an epoch may hold the last reference to a
group (whose destructor waits for the group's threads without the GIL): the abort hook
holds its link weakly, and the build and NCCL abort threads let theirs go before they
say they are done.

Lifetime: one `ExitGuard` per process, `EXIT_GUARD`, made when this module is first
imported; `atexit` runs its `close` once, while other threads can still run. After it no
watch thread starts a store call, no reaper drops a group, and every live group with
no work in flight is dropped, its threads joined.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Protocol

from keepstep.elastic.comm.reap import Reaper

_CALLS_EXIT_WAIT_S = 2.0  # for store calls under way (a healthy store answers in ~0.1 ms)
_REAP_EXIT_WAIT_S = 5.0  # for reapers that are dropping a group


class Listener(Protocol):
    """A watch whose listener thread may sit in a store wait until it is closed."""

    listened: threading.Event  # set once the listener has ended

    def close(self) -> None: ...


class StoreCalls:
    """Counts watch threads inside a store call, which runs without the GIL.

    At exit no new call starts (``enter`` says False), and the calls under way are given a
    moment to return.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._exiting = False

    @property
    def busy(self) -> int:
        """How many store calls are under way now."""
        with self._cond:
            return self._busy

    def enter(self) -> bool:
        """Whether a store call may start now; if so, ``leave`` must follow it."""
        with self._cond:
            if self._exiting:
                return False
            self._busy += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def close(self, wait_s: float) -> None:
        """Admit no more calls; wait up to ``wait_s`` for those under way."""
        with self._cond:
            self._exiting = True
            self._cond.wait_for(lambda: self._busy == 0, wait_s)


class ExitGuard:
    """Stops the communicator's threads before the interpreter finalizes (see the module)."""

    def __init__(self) -> None:
        self.calls = StoreCalls()
        self.reaper = Reaper()
        self._lock = threading.Lock()
        self._listeners: set[Listener] = set()

    def listening(self, watch: Listener) -> None:
        """``watch`` has a listener that may sit in a store wait until it is closed."""
        with self._lock:
            self._listeners.add(watch)

    def stopped_listening(self, watch: Listener) -> None:
        with self._lock:
            self._listeners.discard(watch)

    def close(self) -> None:
        """Settle everything before finalizing; runs once, from atexit."""
        self.reaper.close(_REAP_EXIT_WAIT_S)
        # Listeners sit in a store call for the whole epoch: let them go first, so none
        # wakes under a finalizing interpreter, then wait for every other call under way.
        with self._lock:
            watches = list(self._listeners)
        for watch in watches:
            watch.close()
        deadline = time.monotonic() + _CALLS_EXIT_WAIT_S
        for watch in watches:
            watch.listened.wait(max(deadline - time.monotonic(), 0.0))
        self.calls.close(max(deadline - time.monotonic(), 0.0))
        self.reaper.drop_idle()  # the live groups' threads end while Python still runs


EXIT_GUARD = ExitGuard()
atexit.register(EXIT_GUARD.close)
