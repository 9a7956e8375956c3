"""The NCCL transport: CUDA tensors of one device, one NCCL communicator per epoch.

Where it sits: behind the seam of transport.py, chosen for CUDA tensors. `Communicator`
(communicator.py) asks `NcclTransport.connect` for the epoch's `NcclLink` on the build
thread of group.py; nccl_group.py builds the torch group (guarded: it needs a GPU), and
nccl_policy.py holds every decision, pure and tested on the CPU.

What differs from gloo:

- A wait can sit where no slice ends (a CUDA sync of the caller's, a kernel spinning on a
  dead peer). So ``interrupt`` (called by the listener as soon as it hears the abort)
  aborts the communicator from a thread of its own, and the caller's wait fails.
- A communicator holds the GPU: never more than one is live per process (`OneLive`). The
  next epoch's connect waits (bounded) for the previous one to be aborted, and refuses
  if it was never closed.
- Buffers: every collective started on a link is held (with its tensors) until its work
  is over, even after the link was retired: NCCL may still write into them.
- A communicator that does not let go within ``abort_deadline`` of its abort means a
  wedged device: the worker exits (``WEDGED_EXIT_CODE``) and the agent restarts it from
  the node's snapshot, the kill-worker path.
- Exit: a link is held by the process's reaper until it let its group go, so that a
  group the script never closed is shut down in order at exit (``drop_if_idle``), not
  destroyed as the interpreter finalizes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import AllgatherOptions, Store

from keepstep.elastic.comm.group import EpochSpec
from keepstep.elastic.comm.nccl_group import build_group
from keepstep.elastic.comm.nccl_policy import (
    WEDGED_EXIT_CODE,
    AfterAbort,
    Claim,
    Holder,
    NcclSettings,
    after_abort,
    decide_claim,
)
from keepstep.elastic.comm.reap import Reaper
from keepstep.elastic.comm.transport import Backend, Pending, check_dense
from keepstep.elastic.errors import ConfigError

_HOLD_POLL_S = 0.01  # how often a retired link looks at its abort and its work
_log = logging.getLogger(__name__)

GroupBuilder = Callable[[Store, EpochSpec, torch.device, NcclSettings], Any]


def exit_wedged(reason: str) -> None:
    """Leave at once: this process's device state cannot be trusted (see the module)."""
    sys.stderr.write(f"keepstep: {reason}\n")
    sys.stderr.flush()
    os._exit(WEDGED_EXIT_CODE)


class OneLive:
    """The process's one live NCCL communicator, as an epoch number and its state."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: Holder | None = None

    @property
    def holder(self) -> Holder | None:
        return self._holder

    def claim(self, epoch: int, wait_s: float) -> None:
        """Take the slot for ``epoch``: waits up to ``wait_s`` for an aborting one to go;
        ConfigError if a live one was never closed, RuntimeError if it does not go."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                action, reason = decide_claim(self._holder, epoch)
                if action is Claim.TAKE:
                    self._holder = Holder(epoch, retiring=False)
                    return
                if action is Claim.REFUSE:
                    raise ConfigError(reason)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{reason} after {wait_s:g} s")
                self._cond.wait(left)

    def retiring(self, epoch: int) -> None:
        with self._cond:
            if self._holder is not None and self._holder.epoch == epoch:
                self._holder = Holder(epoch, retiring=True)

    def release(self, epoch: int) -> None:
        with self._cond:
            if self._holder is not None and self._holder.epoch == epoch:
                self._holder = None
                self._cond.notify_all()


ONE_LIVE = OneLive()  # the process's: NCCL refuses more than one rank per GPU anyway


class NcclPending:
    """One NCCL collective in flight; it holds its tensors as long as it lives."""

    def __init__(self, work: Any, tensors: tuple[object, ...], poll_s: float) -> None:
        self._work = work
        self._tensors = tensors  # buffers stay referenced while NCCL may write them
        self._poll_s = poll_s

    def ready(self, slice_ms: int) -> bool:
        # is_completed() queries the work's CUDA event: it never blocks this thread.
        end = time.monotonic() + slice_ms / 1000
        while not self._work.is_completed():
            if time.monotonic() >= end:
                return False
            time.sleep(self._poll_s)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def result(self) -> None:
        # Over: the current stream now waits on NCCL's; a failed or aborted work raises.
        self._work.wait()


class NcclLink:
    """The NCCL communicator of one epoch (see the module)."""

    def __init__(
        self,
        group: Any,
        epoch: int,
        device: torch.device,
        *,
        slot: OneLive,
        settings: NcclSettings,
        reaper: Reaper,
        on_wedged: Callable[[str], None] = exit_wedged,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._group: Any | None = group
        self._epoch = epoch
        self._device = device
        self._slot = slot
        self._settings = settings
        self._reaper = reaper
        self._on_wedged = on_wedged
        self._clock = clock
        self._lock = threading.Lock()
        self._held: list[Pending] = []  # every collective started and not known over
        self._aborted_at: float | None = None
        self.abort_returned = threading.Event()
        self.released = threading.Event()  # aborted, its work over, the group dropped
        reaper.track(self, keep=True)  # shut down at exit, even if the script dropped it

    @property
    def raw(self) -> object:
        return self._group

    @property
    def held(self) -> int:
        """How many started collectives this link still holds buffers for."""
        with self._lock:
            return len(self._held)

    def _start(self, begin: Callable[[Any], Any], tensors: tuple[object, ...]) -> Pending:
        with self._lock:
            group = self._group
            if group is None or self._aborted_at is not None:
                raise RuntimeError(f"epoch {self._epoch}'s NCCL communicator was aborted")
            self._held = [p for p in self._held if not p.is_completed()]
        # Outside the lock: a launch may wait on the communicator, and the listener must
        # still be able to abort it meanwhile.
        pending = NcclPending(begin(group), tensors, self._settings.poll_s)
        with self._lock:
            self._held.append(pending)
        return pending

    def allreduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout: timedelta
    ) -> Pending:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timeout
        return self._start(lambda g: g.allreduce([tensor], opts), (tensor,))

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta) -> Pending:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = timeout
        return self._start(lambda g: g.broadcast([tensor], opts), (tensor,))

    def allgather(
        self, slots: list[torch.Tensor], mine: torch.Tensor, timeout: timedelta
    ) -> Pending:
        opts = AllgatherOptions()
        opts.timeout = timeout
        return self._start(lambda g: g.allgather([slots], [mine], opts), (slots, mine))

    def alltoall(
        self,
        out: torch.Tensor,
        mine: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        timeout: timedelta,
    ) -> Pending:
        opts = dist.AllToAllOptions()
        opts.timeout = timeout
        return self._start(
            lambda g: g.alltoall_base(out, mine, out_splits, in_splits, opts), (out, mine)
        )

    def barrier(self, timeout: timedelta) -> Pending:
        # An all-reduce of one element on our device: NCCL's barrier guesses the device.
        return self.allreduce(torch.ones(1, device=self._device), dist.ReduceOp.SUM, timeout)

    def interrupt(self) -> None:
        with self._lock:
            if self._aborted_at is not None or self._group is None:
                return
            self._aborted_at = self._clock()
            group = self._group
        self._slot.retiring(self._epoch)
        name = f"keepstep-nccl-{self._epoch}"
        # abort() may itself hang on a wedged device: the holder keeps the deadline.
        threading.Thread(
            target=self._abort, args=([group],), name=f"{name}-abort", daemon=True
        ).start()
        del group
        threading.Thread(target=self._hold, name=f"{name}-hold", daemon=True).start()

    def retire(self, pending: Pending | None) -> None:
        if pending is not None:
            with self._lock:
                if self._group is not None and pending not in self._held:
                    self._held.append(pending)
        self.interrupt()

    def _abort(self, box: list[Any]) -> None:
        # The group comes in a box this thread empties: once abort() returned, the holder
        # hands the group to the reaper, and this thread, which ends a moment later, must
        # not hold its last reference then (see communicator._interrupter).
        group = box.pop()
        try:
            group.abort()
        except Exception:
            _log.exception("aborting epoch %d's NCCL communicator failed", self._epoch)
        finally:
            del group
            self.abort_returned.set()

    def _hold(self) -> None:
        deadline = self._settings.abort_deadline
        while True:
            with self._lock:
                aborted_at = self._aborted_at if self._aborted_at is not None else self._clock()
                done = all(p.is_completed() for p in self._held)
            verdict, reason = after_abort(
                self._clock(), aborted_at, self.abort_returned.is_set(), done, deadline, self._epoch
            )
            if verdict is AfterAbort.RELEASE:
                with self._lock:
                    group, self._group = self._group, None
                    self._held = []
                self._reaper.reap(self._epoch, group, None, 0.0)
                self._reaper.forget(self)
                self._slot.release(self._epoch)
                self.released.set()
                return
            if verdict is AfterAbort.EXIT:
                self._on_wedged(reason)
                return
            time.sleep(_HOLD_POLL_S)

    def drop_if_idle(self) -> bool:
        """At exit (``Reaper.drop_idle``): end an idle group in order and drop it here.

        ``shutdown()`` flushes its collectives and destroys its communicator, waited for
        at most ``abort_deadline``. Dropped later instead, as the interpreter finalizes,
        the group's destructor would warn that it was never destroyed and abort it (~1 s),
        and NCCL's watchdog frees finished work there as gloo's worker thread did. A group
        with work in flight, or one being aborted, is left to its holder."""
        with self._lock:
            if self._group is None or self._aborted_at is not None:
                return False
            if not all(p.is_completed() for p in self._held):
                return False
            group, self._group = self._group, None
            self._held = []
        wait_s = self._settings.abort_deadline.total_seconds()
        if not _shut_down(group, wait_s, self._epoch):
            _NEVER_DROPPED.append(group)  # its destructor would wait on the same hang
            return False
        del group  # the last reference: the destructor joins the watchdog here
        self._slot.release(self._epoch)
        self.released.set()
        return True


# Groups whose shutdown at exit did not return: kept, never destroyed, until the process ends.
_NEVER_DROPPED: list[Any] = []


def _shut_down(group: Any, wait_s: float, epoch: int) -> bool:
    """``group.shutdown()`` (``abort()`` where it has none) on a thread of its own,
    waited for at most ``wait_s``; whether it returned. The caller keeps its reference:
    the thread lets its own go before it says it is done."""
    box = [group]
    done = threading.Event()

    def run() -> None:
        held = box.pop()
        try:  # no bound method kept in a local: it too would hold the group
            if hasattr(held, "shutdown"):
                held.shutdown()
            else:
                held.abort()
        except Exception:
            _log.exception("shutting epoch %d's NCCL communicator down failed", epoch)
        finally:
            del held
            done.set()

    threading.Thread(target=run, name=f"keepstep-nccl-{epoch}-shutdown", daemon=True).start()
    if done.wait(wait_s):
        return True
    _log.error(
        "epoch %d's NCCL communicator did not shut down within %g s at exit; it is left",
        epoch,
        wait_s,
    )
    return False


class NcclTransport:
    """Dense CUDA tensors of one device over an NCCL communicator per epoch."""

    def __init__(
        self,
        device: torch.device,
        reaper: Reaper,
        settings: NcclSettings | None = None,
        *,
        slot: OneLive = ONE_LIVE,
        build: GroupBuilder = build_group,
        on_wedged: Callable[[str], None] = exit_wedged,
    ) -> None:
        if not isinstance(device, torch.device) or device.type != "cuda":
            raise ConfigError(f"the NCCL transport needs a cuda device, got {device!r}")
        if device.index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            device = torch.device("cuda", index)
        self._device = device
        self._reaper = reaper
        self._settings = settings if settings is not None else NcclSettings()
        self._slot = slot
        self._build = build
        self._on_wedged = on_wedged

    @property
    def backend(self) -> Backend:
        return Backend.NCCL

    @property
    def device(self) -> torch.device:
        return self._device

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        check_dense(tensor, what, self._device)

    def connect(self, store: Store, spec: EpochSpec) -> NcclLink:
        self._slot.claim(spec.epoch, spec.timeout.total_seconds())
        try:
            group = self._build(store, spec, self._device, self._settings)
        except BaseException:
            self._slot.release(spec.epoch)
            raise
        return NcclLink(
            group,
            spec.epoch,
            self._device,
            slot=self._slot,
            settings=self._settings,
            reaper=self._reaper,
            on_wedged=self._on_wedged,
        )
