"""Collectives among the members of one epoch, and the one object that owns that epoch.

Where it sits: once the agents agree on epoch ``e`` and its sorted members, every training
process calls ``Communicator.create(store, e, members, me)`` (the group is built by
group.py); the reducer runs its collectives through it; on ``PeerLost`` the agents agree on
``e + 1`` and the job builds the next communicator in the same process.

Giving up fast: gloo reports a dead peer only to its direct neighbours; other ranks would
block until the group timeout. So collectives run asynchronously and the caller waits in
short slices on the epoch's `AbortWatch` (watch.py). A rank that sees a gloo error or times
out writes the abort key (the first reason wins), which every other rank hears at once.

Tearing down: a given-up group still has gloo threads blocked on the dead peer, and its
destructor joins them. The process's reaper (reap.py) takes it, waits for the pending work
to fail and drops it, so ``close()`` and the next ``create()`` never wait. Until then the
work is live: if the peer it waits for was only stopped and comes back, the work completes
and writes into the tensor it was handed, after ``PeerLost`` was raised. So a caller must
not reuse a tensor whose collective raised ``PeerLost`` (the reducers take a fresh buffer).
No Python callback is ever attached to gloo work: one could fire while the interpreter
shuts down and kill the process (seen as ``terminate called after throwing
gloo::IoException``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import AllgatherOptions, Store

from keepstep.elastic.comm.abort import short_reason
from keepstep.elastic.comm.exit_guard import EXIT_GUARD, ExitGuard
from keepstep.elastic.comm.group import EpochSpec, GroupBuild, check_timeout
from keepstep.elastic.comm.watch import WATCH_TIMEOUT, AbortWatch, Outcome
from keepstep.elastic.errors import BadMessage, ConfigError, PeerLost

_REAP_GRACE_S = 5.0  # beyond the op timeout, after which a reaper drops the group anyway


class Communicator:
    """Collectives among the members of one epoch; build with ``create``, end with ``close``.

    A collective either completes or raises ``PeerLost``, which is latched: every later
    call raises it too. Use it from one thread; ``close`` may come from any thread.

    It owns everything of its epoch in this process: the abort watch (a listener and a
    reader thread, each on its own store connection), the gloo group (on a store connection
    of its own) and the work in flight. ``close`` ends the watch's threads, which close
    their connections, and hands the group to the reaper.
    """

    def __init__(
        self,
        spec: EpochSpec,
        watch: AbortWatch,
        group: Any | None,
        build_seconds: float,
        guard: ExitGuard,
    ) -> None:
        self.epoch: int = spec.epoch
        self.members: tuple[str, ...] = spec.members
        self.me: str = spec.me
        self.rank: int = spec.rank
        self.size: int = spec.size
        self.build_seconds: float = build_seconds
        self._timeout = spec.timeout
        self._watch = watch
        self._group = group
        self._guard = guard
        self._inflight: Any | None = None  # the gloo work being waited on, for close()
        self._lost: str | None = None
        self._closed = threading.Event()

    @classmethod
    def create(
        cls,
        store: Store,
        epoch: int,
        members: Sequence[str],
        me: str,
        timeout: timedelta = timedelta(seconds=30),
        host: str = "127.0.0.1",
        store_timeout: timedelta = WATCH_TIMEOUT,
    ) -> Communicator:
        """Build the group of ``epoch``; every member calls this with the same arguments.

        Blocks until all members joined; ``PeerLost`` if ``timeout`` passes first or the
        epoch is aborted. ``timeout`` is also every collective's default timeout;
        ``store_timeout`` bounds each read of the abort key (a store silent that long is
        taken as gone: the epoch is over).
        """
        start = time.perf_counter()
        spec = EpochSpec(epoch, tuple(members), me, timeout, host)
        guard = EXIT_GUARD
        build = GroupBuild(store, spec) if spec.size > 1 else None
        # Its connections open while the group connects; if anything below fails, its
        # threads end here and close them.
        watch = AbortWatch(store, epoch, spec.rank, spec.size, guard, store_timeout)
        try:
            group = build.result(watch) if build is not None else None
            # Aborted before or while we built: fail now, not at the first collective.
            if watch.check(fresh=True) is not None:
                if group is not None:
                    guard.reaper.reap(epoch, group, None, 0.0)
                raise PeerLost(epoch, cast(str, watch.reason))
        except BaseException:
            watch.close()
            raise
        return cls(spec, watch, group, time.perf_counter() - start, guard)

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        timeout: timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` in place across all members (e.g. int64 SUM, float64 MAX)."""
        _check_tensor(tensor, "allreduce")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._collective("allreduce", opts, lambda g, o: g.allreduce([tensor], o), timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta | None = None) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        _check_tensor(tensor, "broadcast")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.size:
            raise ConfigError(f"src must be a rank in [0, {self.size}), got {src!r}")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._collective("broadcast", opts, lambda g, o: g.broadcast([tensor], o), timeout)

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        """Every member's ``payload`` in rank order; none may be longer than ``max_bytes``.

        Raw bytes only: decoding (and validating) them is the caller's. Two rounds under one
        deadline: the lengths, then the payloads padded to the longest. Every rank checks
        every length before the second round, so all refuse an oversized payload together
        (``BadMessage`` naming its rank) instead of leaving the others waiting.
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ConfigError(f"max_bytes must be an int >= 1, got {max_bytes!r}")
        if self.size == 1:
            self._collective("allgather_bytes", None, None, timeout)
            _check_lengths([len(payload)], max_bytes)
            return [bytes(payload)]
        deadline = time.monotonic() + self._op_timeout(timeout).total_seconds()
        mine = torch.tensor([len(payload)], dtype=torch.int64)
        lengths = [int(n) for n in self._allgather("allgather_bytes (lengths)", mine, deadline)]
        _check_lengths(lengths, max_bytes)
        # At least one byte: gloo is not asked to gather empty tensors.
        padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
        if payload:
            padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        slots = self._allgather("allgather_bytes", padded, deadline)
        return [s[:n].numpy().tobytes() for s, n in zip(slots, lengths, strict=True)]

    def barrier(self, timeout: timedelta | None = None) -> None:
        """Return once every member entered the barrier."""
        opts = dist.BarrierOptions()
        self._collective("barrier", opts, lambda g, o: g.barrier(o), timeout)

    def aborted(self, wait: bool = True) -> bool:
        """True once this epoch was given up here or aborted anywhere.

        With ``wait`` it waits briefly for a fresh read of the abort key; without, it answers
        from the last read at once and asks for a fresh one in the background (for checks on
        the training path, where one stale answer only delays the stop by one check).
        """
        if self._lost is not None:
            return True
        return self._watch.check(fresh=wait) is not None

    def close(self) -> None:
        """Release the group without waiting on it; idempotent, callable from any thread."""
        if self._lost is None:
            self._lost = "communicator closed"
        self._closed.set()
        self._watch.close()
        self._retire(self._inflight)

    def _retire(self, work: Any | None) -> None:
        group, self._group = self._group, None
        if group is not None:
            bound_s = self._timeout.total_seconds() + _REAP_GRACE_S
            self._guard.reaper.reap(self.epoch, group, work, bound_s)

    def _op_timeout(self, timeout: timedelta | None) -> timedelta:
        if timeout is None:
            return self._timeout
        check_timeout(timeout)
        return timeout

    def _give_up(self, reason: str, work: Any | None) -> PeerLost:
        if self._lost is None:
            self._lost = reason
        self._retire(work)
        return PeerLost(self.epoch, self._lost)

    def _allgather(self, what: str, mine: torch.Tensor, deadline: float) -> list[torch.Tensor]:
        slots = [torch.empty_like(mine) for _ in range(self.size)]
        gather = lambda g, o: g.allgather([slots], [mine], o)  # noqa: E731
        self._collective(what, AllgatherOptions(), gather, _left(deadline))
        return slots

    def _collective(
        self,
        what: str,
        opts: Any,
        start: Callable[[Any, Any], Any] | None,
        timeout: timedelta | None,
    ) -> None:
        op_timeout = self._op_timeout(timeout)
        if self._lost is not None:
            raise PeerLost(self.epoch, self._lost)
        if self._watch.reason is not None or (
            self.size == 1 and self._watch.check(fresh=True) is not None
        ):
            # One member has nothing to exchange, but still honours an outside abort.
            raise self._give_up(cast(str, self._watch.reason), None)
        if self.size == 1 or start is None:
            return
        if self._group is None:
            raise PeerLost(self.epoch, "communicator closed")
        who = f"rank {self.rank} ({self.me}): {what}"
        opts.timeout = op_timeout  # gloo gives up on its own at the same deadline
        try:
            work = start(self._group, opts)
        except RuntimeError as err:
            reason = self._watch.fire(f"{who} failed: {short_reason(err)}")
            raise self._give_up(reason, None) from err
        deadline = time.monotonic() + op_timeout.total_seconds()
        self._inflight = work
        try:
            outcome = self._watch.wait(_work_ready(work), deadline, self._closed)
        finally:
            self._inflight = None
        if outcome is Outcome.CLOSED:
            raise PeerLost(self.epoch, self._lost or "communicator closed")
        if outcome is Outcome.ABORTED:
            raise self._give_up(cast(str, self._watch.reason), work)
        if outcome is Outcome.TIMED_OUT:
            reason = f"{who} timed out after {op_timeout.total_seconds():g} s"
            raise self._give_up(self._watch.fire(reason), work)
        try:
            work.wait()  # completed: returns at once, or raises the gloo error
        except RuntimeError as err:
            reason = self._watch.fire(f"{who} failed: {short_reason(err)}")
            raise self._give_up(reason, work) from err


def _work_ready(work: Any) -> Callable[[int], bool]:
    def ready(slice_ms: int) -> bool:
        try:
            work.wait(timedelta(milliseconds=slice_ms))
        except RuntimeError:
            pass  # the slice ran out, or the work failed: is_completed() tells which
        return bool(work.is_completed())

    return ready


def _left(deadline: float) -> timedelta:
    # At least a millisecond: a spent deadline should time the next round out, not be
    # refused as an invalid timeout.
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _check_lengths(lengths: list[int], max_bytes: int) -> None:
    for rank, n in enumerate(lengths):
        if not 0 <= n <= max_bytes:
            raise BadMessage(
                f"allgather_bytes: rank {rank} sent {n} bytes; allowed are 0 to {max_bytes}"
            )


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ConfigError(
            f"{what} needs a dense CPU tensor, got {tensor.layout} on {tensor.device}"
        )
    if not tensor.is_contiguous():
        raise ConfigError(f"{what} needs a contiguous tensor; call .contiguous() first")
