"""Collectives among the members of one epoch, and the one object that owns that epoch.

Where it sits: once the agents agree on epoch ``e`` and its sorted members, every training
process calls ``Communicator.create(store, e, members, me)`` (group.py builds the group);
the reducer runs its collectives through it; on ``PeerLost`` the agents agree on ``e + 1``
and the job builds the next communicator in the same process.

Giving up fast: gloo tells only a dead peer's neighbours; others would block until the
group timeout. So collectives run asynchronously, waited on in short slices of the epoch's
`AbortWatch` (watch.py): a rank that sees an error or times out writes the abort key.

Backends: what differs between gloo (CPU) and NCCL (CUDA) is behind transport.py: connecting,
starting, polling and interrupting a collective (the listener does at the abort: an NCCL
wait can sit in a device sync no slice ends), retiring the group.

Tearing down: a given-up group's link retires it without waiting (gloo.py: reaped once its
work failed; nccl.py: aborted, held until its work ended), so ``close()`` and the next
``create()`` never wait. Until then its work may still write into the tensor it was handed
after ``PeerLost``: a caller must not reuse that tensor (kept buffers are kept per epoch).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import Store

from keepstep.elastic.comm import rounds
from keepstep.elastic.comm.abort import short_reason
from keepstep.elastic.comm.exit_guard import EXIT_GUARD, ExitGuard
from keepstep.elastic.comm.gloo import GlooTransport
from keepstep.elastic.comm.group import EpochSpec, GroupBuild, check_timeout
from keepstep.elastic.comm.nccl import NcclTransport
from keepstep.elastic.comm.payloads import PayloadRounds
from keepstep.elastic.comm.rounds import Alloc, left
from keepstep.elastic.comm.transport import Backend, Link, Pending, Transport, select_backend
from keepstep.elastic.comm.watch import WATCH_TIMEOUT, AbortWatch, Outcome
from keepstep.elastic.errors import ConfigError, PeerLost


class Communicator(PayloadRounds):
    """Collectives among the members of one epoch; build with ``create``, end with ``close``.

    A collective either completes or raises ``PeerLost``, which is latched: every later
    call raises it too. Use it from one thread; ``close`` may come from any thread.

    It owns everything of its epoch in this process: the abort watch (a listener and a
    reader thread, each on its own store connection), the transport's link (the group, on a
    store connection of its own) and the work in flight. ``close`` ends the watch's
    threads, which close their connections, and retires the link.
    """

    def __init__(
        self,
        spec: EpochSpec,
        watch: AbortWatch,
        link: Link | None,
        build_seconds: float,
        transport: Transport,
    ) -> None:
        self.epoch: int = spec.epoch
        self.members: tuple[str, ...] = spec.members
        self.me: str = spec.me
        self.rank: int = spec.rank
        self.size: int = spec.size
        self.build_seconds: float = build_seconds
        self.backend: Backend = transport.backend
        self.device: torch.device = transport.device
        self._timeout = spec.timeout
        self._watch = watch
        self._link = link
        self._transport = transport
        self._inflight: Pending | None = None  # the work being waited on, for close()
        self._lost: str | None = None
        self._closed = threading.Event()
        if link is not None:
            # From the thread that hears the abort first: the caller may be stuck where no
            # slice ends (an NCCL wait in a device sync).
            watch.when_aborted(_interrupter(link))

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
        *,
        device: torch.device | str | None = None,
        backend: Backend | str | None = None,
    ) -> Communicator:
        """Build the group of ``epoch``; every member calls this with the same arguments.

        Blocks until all members joined; ``PeerLost`` if ``timeout`` passes first or the
        epoch is aborted. ``timeout`` is also every collective's default timeout;
        ``store_timeout`` bounds each read of the abort key (a store silent that long is
        taken as gone: the epoch is over). ``device`` is where the tensors live (``None``:
        the CPU) and picks the backend (cpu: gloo, cuda: NCCL) unless ``backend`` names it.
        """
        chosen = select_backend(device, backend)
        transport: Transport
        if chosen is Backend.NCCL:
            transport = NcclTransport(torch.device(device or "cuda"), EXIT_GUARD.reaper)
        else:
            transport = GlooTransport(EXIT_GUARD.reaper)
        return cls.over(transport, store, epoch, members, me, timeout, host, store_timeout)

    @classmethod
    def over(
        cls,
        transport: Transport,
        store: Store,
        epoch: int,
        members: Sequence[str],
        me: str,
        timeout: timedelta = timedelta(seconds=30),
        host: str = "127.0.0.1",
        store_timeout: timedelta = WATCH_TIMEOUT,
        guard: ExitGuard = EXIT_GUARD,
    ) -> Communicator:
        """``create`` with a transport of the caller's (a test's fake, a tuned NCCL one)."""
        start = time.perf_counter()
        spec = EpochSpec(epoch, tuple(members), me, timeout, host)
        build = GroupBuild(store, spec, transport) if spec.size > 1 else None
        # Its connections open while the group connects; if anything below fails, its
        # threads end here and close them.
        watch = AbortWatch(store, epoch, spec.rank, spec.size, guard, store_timeout)
        try:
            link = build.result(watch) if build is not None else None
            # Aborted before or while we built: fail now, not at the first collective.
            if watch.check(fresh=True) is not None:
                if link is not None:
                    link.retire(None)
                raise PeerLost(epoch, cast(str, watch.reason))
        except BaseException:
            watch.close()
            raise
        return cls(spec, watch, link, time.perf_counter() - start, transport)

    @property
    def _group(self) -> object:
        """The library's group of this epoch (tests act through it as a peer would)."""
        return self._link.raw if self._link is not None else None

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        timeout: timedelta | None = None,
    ) -> None:
        """Reduce ``tensor`` in place across all members (e.g. int64 SUM, float64 MAX)."""
        self._transport.check_tensor(tensor, "allreduce")
        self._collective("allreduce", lambda k, t: k.allreduce(tensor, op, t), timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta | None = None) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        self._transport.check_tensor(tensor, "broadcast")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.size:
            raise ConfigError(f"src must be a rank in [0, {self.size}), got {src!r}")
        self._collective("broadcast", lambda k, t: k.broadcast(tensor, src, t), timeout)

    def allgather(
        self,
        tensor: torch.Tensor,
        timeout: timedelta | None = None,
        into: Alloc | None = None,
    ) -> list[torch.Tensor]:
        """Every member's ``tensor`` in rank order; all members pass the same shape and
        dtype (``allgather_bytes`` for payloads whose lengths differ). A 1-D uint8 one may
        be received ``into`` a buffer the caller keeps (as ``alltoall_tensors``)."""
        self._transport.check_tensor(tensor, "allgather")
        if self.size == 1:
            self._collective("allgather", None, timeout)
            return [tensor.clone()]
        deadline = time.monotonic() + self._op_timeout(timeout).total_seconds()
        return self._allgather("allgather", tensor, deadline, into)

    def reduce_scatter(
        self, tensor: torch.Tensor, timeout: timedelta | None = None, into: Alloc | None = None
    ) -> torch.Tensor:
        """SUM over members of ``tensor`` (1-D, cut into ``size`` equal slices in rank
        order): returns this rank's slice summed over every member's tensor.

        One ``alltoall`` (each member sends each peer that peer's slice: the bytes of a
        ring reduce-scatter), then the slices are added here, into the received copy of
        this rank's own. Exact for the exact mode's integers held in float64, where any
        order of additions gives the same bits. With ``into`` (as ``alltoall_tensors``)
        the slices are received into a buffer the caller keeps, and the result is a view
        of it, valid until the next call."""
        self._transport.check_tensor(tensor, "reduce_scatter")
        if tensor.dim() != 1 or tensor.numel() % self.size:
            raise ConfigError(
                f"reduce_scatter needs a 1-D tensor of a multiple of {self.size} elements, "
                f"got shape {tuple(tensor.shape)}"
            )
        n = tensor.numel() // self.size
        if self.size == 1:
            self._collective("reduce_scatter", None, timeout)
            return tensor.clone()
        got = rounds.receive_like(tensor, self.device, into)
        splits = [n] * self.size
        self._collective(
            "reduce_scatter", lambda k, t: k.alltoall(got, tensor, splits, splits, t), timeout
        )
        return rounds.sum_slices(got, self.size, self.rank)

    def barrier(self, timeout: timedelta | None = None) -> None:
        """Return once every member entered the barrier."""
        self._collective("barrier", lambda k, t: k.barrier(t), timeout)

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

    def stop_watch(self, wait_s: float) -> None:
        """End the abort watch and wait (at most ``wait_s``) for its listener to leave its
        store wait; the group stays usable, but a lost peer is now found by a collective's
        own timeout only. A worker whose part is over does this before its store
        connections are shut, so that none of its threads is in a store call then (c10d
        logs each such call's failure, with a C++ stack)."""
        self._watch.close()
        self._watch.listened.wait(wait_s)

    def _retire(self, pending: Pending | None) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.retire(pending)

    def _op_timeout(self, timeout: timedelta | None) -> timedelta:
        if timeout is None:
            return self._timeout
        check_timeout(timeout)
        return timeout

    def _give_up(self, reason: str, pending: Pending | None) -> PeerLost:
        if self._lost is None:
            self._lost = reason
        self._retire(pending)
        return PeerLost(self.epoch, self._lost)

    def _allgather(
        self, what: str, mine: torch.Tensor, deadline: float, into: Alloc | None = None
    ) -> list[torch.Tensor]:
        slots = rounds.slots(mine, self.size, self.device, into)
        self._collective(what, lambda k, t: k.allgather(slots, mine, t), left(deadline))
        return slots

    def _collective(
        self,
        what: str,
        start: Callable[[Link, timedelta], Pending] | None,
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
        link = self._link
        if link is None:
            raise PeerLost(self.epoch, "communicator closed")
        who = f"rank {self.rank} ({self.me}): {what}"
        try:
            pending = start(link, op_timeout)
        except RuntimeError as err:
            reason = self._watch.fire(f"{who} failed: {short_reason(err)}")
            raise self._give_up(reason, None) from err
        deadline = time.monotonic() + op_timeout.total_seconds()
        self._inflight = pending
        try:
            outcome = self._watch.wait(pending.ready, deadline, self._closed)
        finally:
            self._inflight = None
        if outcome is Outcome.CLOSED:
            raise PeerLost(self.epoch, self._lost or "communicator closed")
        if outcome is Outcome.ABORTED:
            raise self._give_up(cast(str, self._watch.reason), pending)
        if outcome is Outcome.TIMED_OUT:
            reason = f"{who} timed out after {op_timeout.total_seconds():g} s"
            raise self._give_up(self._watch.fire(reason), pending)
        try:
            pending.result()  # over: returns at once, or raises the backend's error
        except RuntimeError as err:
            reason = self._watch.fire(f"{who} failed: {short_reason(err)}")
            raise self._give_up(reason, pending) from err


def _interrupter(link: Link) -> Callable[[], None]:
    """``link.interrupt`` as a hook that holds ``link`` weakly.

    The watch's threads keep their watch, and with it its hooks, until their very end. A
    hook holding the link would let such a thread drop the link's last reference once the
    communicator is gone, and with it the group, whose destructor waits for the group's
    threads without the GIL. A thread that ends that way as the interpreter finalizes is
    killed when it takes the GIL back, and the process with SIGABRT after its work was done
    (a core of a two-rank job's worker, exiting right after its last step, showed exactly
    that). Held weakly, the link goes with its communicator, on the thread that drops it.
    """
    ref = weakref.ref(link)

    def interrupt() -> None:
        live = ref()
        if live is not None:
            live.interrupt()

    return interrupt
