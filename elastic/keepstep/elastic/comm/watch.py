"""The threads that watch one epoch's abort key for one rank.

Where it sits: below communicator.py, which runs every collective in short slices and asks
its `AbortWatch` between slices whether the epoch was given up anywhere. The key and how
it is written are in abort.py; the exit guard (exit_guard.py) stops the watch's threads if
the interpreter exits while it still runs.

An abort is pushed, not polled for: the listener thread sits in a store wait on the rank's
wake key, set by whoever writes the abort key. Reads of the key remain for what a push
cannot tell: whether the store still answers at all (a wait that has lasted
`PUSH_TRUSTED_S` reads it every `POLL_INTERVAL_S`), and callers that ask for a fresh answer.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import cast

from torch._C._distributed_c10d import Store

from keepstep.elastic.comm.abort import abort_key, short_reason, wake, wake_key
from keepstep.elastic.comm.exit_guard import EXIT_GUARD, ExitGuard
from keepstep.elastic.errors import ConfigError

# Wait slices: each ends early when the work completes and is followed by a look at the
# abort key. A short one while a read of the key is under way (its answer comes in well
# under a millisecond), else a long one: the key is read at most every POLL_INTERVAL_S, and
# each slice that runs out costs a C++ exception (~35 us). gloo reads a 0 ms wait as "no
# timeout", hence whole milliseconds and at least one.
SLICE_SHORT_MS = 1
SLICE_LONG_MS = 20
# A look between slices reads the key afresh (a store round trip and two thread wake-ups)
# at most this often. Every rank waiting at the step's all-reduce polls, and on a machine
# whose cores all train, polling at every slice took ~5% of the step; an abort is now seen
# up to this much later.
POLL_INTERVAL_S = 0.02
# Checks between micro-batches read it at most this often: a stop found there only saves
# compute the aborted step throws away (the wait at the all-reduce finds it within
# POLL_INTERVAL_S anyway). All reads, with their thread and store wake-ups, took ~1.5% of
# a 4-node run's CPU on 2 cores, and one read per micro-batch was most of them.
COMPUTE_POLL_INTERVAL_S = 0.1
# While the push listener waits, an abort arrives by itself: a collective's wait reads the
# key only once it has lasted this long (so a store that went silent is still found), and
# checks between micro-batches only this often. In steady state a wait at the step's
# all-reduce is shorter, and no rank reads the store at all.
PUSH_TRUSTED_S = 0.25
PUSHED_POLL_INTERVAL_S = 1.0
# How long an abort poll waits for the epoch's store. A loaded machine can delay a
# healthy store by a fraction of a second; a hung store node must not delay a hang's
# detection by much more than the agents' own lease timeout.
WATCH_TIMEOUT = timedelta(seconds=2)
# How long a caller that asks "aborted?" waits for a fresh read before taking the last one.
FRESH_READ_S = 0.05
# The listener's store wait. One that runs out logs c10d warnings, so it is long, and
# re-armed when it does run out.
_LISTEN_WAIT = timedelta(days=7)


class Outcome(enum.Enum):
    """How `AbortWatch.wait` ended."""

    DONE = "done"  # finished, successfully or not
    ABORTED = "aborted"
    CLOSED = "closed"
    TIMED_OUT = "timed out"


class AbortWatch:
    """Hears, reads and writes the abort key of one epoch for one rank, from threads of its own.

    The store lives on a node of the epoch, and a store call to a stopped node blocks
    without any timeout (the kernel still accepts the bytes). So no store call ever runs
    on the caller's thread. The listener blocks in a store wait on the rank's wake key and
    takes the reason when woken; the reader makes the reads and writes asked of it. ``poll``
    asks for a fresh read and returns what is known; a read unanswered for
    ``store_timeout`` (``WATCH_TIMEOUT`` unless the epoch's timeouts were raised) means the
    store's node died or hangs, and the epoch cannot be trusted
    any more, which is an abort.

    It owns both threads and their store connections (each its own clone of ``store``);
    ``close`` ends them, and each closes its connection as it ends.
    """

    def __init__(
        self,
        store: Store,
        epoch: int,
        rank: int,
        ranks: int,
        guard: ExitGuard = EXIT_GUARD,
        store_timeout: timedelta = WATCH_TIMEOUT,
    ) -> None:
        if store_timeout <= timedelta(0):
            raise ConfigError(f"store_timeout={store_timeout} must be positive")
        self._store_timeout = store_timeout.total_seconds()
        self._origin = store
        self._epoch = epoch
        self._rank = rank
        self._ranks = ranks
        self._key = abort_key(epoch)
        self._guard = guard
        self.reason: str | None = None
        self._wake = threading.Condition(threading.Lock())
        self._asked_at: float | None = None  # a read was requested and is not answered
        self._read_at = -math.inf  # when the last read was asked for
        self._to_fire: str | None = None
        self._fired = threading.Event()
        self._stopped = False
        self._armed = False  # the listener is in (or about to enter) its store wait
        self.listened = threading.Event()  # the listener has ended
        self._hooks: list[Callable[[], None]] = []  # run once the epoch is given up
        guard.listening(self)
        threading.Thread(target=self._run, name=f"keepstep-abort-{epoch}", daemon=True).start()
        threading.Thread(
            target=self._listen, name=f"keepstep-abort-wake-{epoch}", daemon=True
        ).start()

    @property
    def pushed(self) -> bool:
        """True while an abort written now would reach this rank without a read."""
        return self._armed

    def _connection(self) -> Store | None:
        """A private connection: a call on it never queues behind another thread's."""
        if not self._guard.calls.enter():
            return None
        try:
            return self._origin.clone()
        except (RuntimeError, NotImplementedError):
            return self._origin
        finally:
            self._guard.calls.leave()

    # -- the listener --------------------------------------------------------------------
    def _listen(self) -> None:
        try:
            store = self._connection()
            if store is not None:
                self._await_wake(store)
        finally:
            with self._wake:
                self._armed = False
                self._wake.notify_all()
            self._guard.stopped_listening(self)
            self.listened.set()

    def _await_wake(self, store: Store) -> None:
        key = wake_key(self._epoch, self._rank)
        calls = self._guard.calls
        while True:
            with self._wake:
                if self._stopped or self.reason is not None:
                    return
                self._armed = True
            if not calls.enter():
                return
            began = time.monotonic()
            try:
                store.wait([key], _LISTEN_WAIT)
                if self._stopped:
                    return  # woken by close()
                reason = store.get(self._key).decode(errors="replace")
            except RuntimeError as error:
                if time.monotonic() - began >= _LISTEN_WAIT.total_seconds():
                    continue  # the wait ran out: wait again
                if self._stopped:
                    return
                reason = f"the epoch's store failed: {short_reason(error)}"
            finally:
                calls.leave()
            self._settle(reason)
            return

    # -- the reader ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            # Nothing more will be written: a `fire` still waiting must not wait out its
            # timeout (the reason it returns is known by now, or its own stands).
            self._fired.set()

    def _serve(self) -> None:
        store = self._connection()
        if store is None:
            return
        calls = self._guard.calls
        while True:
            with self._wake:
                while not self._stopped and self._asked_at is None and self._to_fire is None:
                    self._wake.wait()
                stopped, to_fire = self._stopped, self._to_fire
            if not calls.enter():
                return
            try:
                if stopped:
                    if not self.listened.is_set():  # let the listener go
                        wake(store, self._epoch, range(self._rank, self._rank + 1))
                    return
                if to_fire is not None:
                    won = store.compare_set(self._key, "", to_fire).decode(errors="replace")
                    self._settle(won)
                    wake(store, self._epoch, range(self._ranks))
                    self._fired.set()
                elif store.check([self._key]):
                    self._settle(store.get(self._key).decode(errors="replace"))
            except RuntimeError as error:  # torch's DistStoreError is a RuntimeError
                self._settle(f"the epoch's store failed: {short_reason(error)}")
                self._fired.set()
                return
            finally:
                calls.leave()
            with self._wake:
                self._asked_at = None
                self._wake.notify_all()
                if self.reason is not None:
                    return  # the writer of the abort key wakes the listener too

    def _settle(self, reason: str) -> None:
        with self._wake:
            first = self.reason is None
            if first:
                self.reason = reason
            self._wake.notify_all()  # a poll waiting for a fresh read has its answer
        if first:
            self._run_hooks()

    def when_aborted(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the epoch is given up: at once if it is already, else on the
        thread that learns it first (usually the listener). A hook must not block: the
        communicator's interrupts its transport's work from here while the caller's thread
        may be stuck in a device sync."""
        with self._wake:
            if self.reason is None:
                self._hooks.append(hook)
                return
        _call(hook)

    def _run_hooks(self) -> None:
        with self._wake:
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            _call(hook)

    # -- the caller's side ---------------------------------------------------------------
    def poll(self, wait: float = 0.0, every: float = POLL_INTERVAL_S) -> str | None:
        """The abort reason if one is known. With ``wait`` it asks for a fresh read and
        waits at most that many seconds for it (a healthy store answers in well under a
        millisecond); without, it asks only if the last read is ``every`` seconds old."""
        timed_out: str | None = None
        with self._wake:
            if self._stopped:
                return self.reason  # closed: nobody reads the key any more
            if self.reason is None:
                now = time.monotonic()
                if self._asked_at is None:
                    if wait > 0 or now - self._read_at >= every:
                        self._asked_at = self._read_at = now
                        self._wake.notify_all()
                elif now - self._asked_at > self._store_timeout:
                    self.reason = timed_out = (
                        f"the epoch's store did not answer within "
                        f"{self._store_timeout:g} s (its node died or hangs)"
                    )
                if wait > 0:
                    self._wake.wait_for(
                        lambda: self._asked_at is None or self.reason is not None, wait
                    )
            reason = self.reason
        if timed_out is not None and reason == timed_out:
            self._run_hooks()
        return reason

    def check(self, fresh: bool) -> str | None:
        """The abort reason if one is known, as a caller outside a collective asks.

        ``fresh`` waits up to ``FRESH_READ_S`` for a read made now; otherwise it answers
        from the last read at once and asks for a new one if that is old (checks on the
        training path, where one stale answer only delays the stop by one check).
        """
        if fresh:
            return self.poll(FRESH_READ_S)
        return self.poll(every=PUSHED_POLL_INTERVAL_S if self._armed else COMPUTE_POLL_INTERVAL_S)

    def fire(self, reason: str) -> str:
        """Publish ``reason`` unless another rank was first; return the winning reason."""
        with self._wake:
            if self.reason is not None:
                return self.reason  # already known (a poll read another rank's): nothing to write
            if self._to_fire is None:
                self._to_fire = reason
                self._wake.notify_all()
        self._fired.wait(self._store_timeout)
        self._settle(reason)  # unanswered: the store is gone, our own reason stands
        return cast(str, self.reason)

    def close(self) -> None:
        """End both threads (without waiting); idempotent, callable from any thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()

    def wait(
        self, ready: Callable[[int], bool], deadline: float, closed: threading.Event
    ) -> Outcome:
        """Wait until ``ready(slice_ms)`` (which may block up to ``slice_ms``) says done.

        Between slices it takes a pushed abort as it comes; once the wait has lasted
        ``PUSH_TRUSTED_S`` (or with no listener) it also reads the key, which finds a store
        that stopped answering.
        """
        slice_ms = SLICE_SHORT_MS
        trusted_until = time.monotonic() + PUSH_TRUSTED_S
        while True:
            if ready(slice_ms):
                return Outcome.DONE
            if closed.is_set():
                return Outcome.CLOSED
            if self._armed and time.monotonic() < trusted_until:
                reason = self.reason
            else:
                reason = self.poll()
            if reason is not None:
                return Outcome.ABORTED
            if time.monotonic() >= deadline:
                return Outcome.TIMED_OUT
            slice_ms = SLICE_SHORT_MS if self._asked_at is not None else SLICE_LONG_MS


def _call(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:  # a hook's failure must not end the thread that heard the abort
        logging.getLogger(__name__).exception("an abort hook failed")
