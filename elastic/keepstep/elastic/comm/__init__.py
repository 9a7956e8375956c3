"""Communicator of one membership epoch: a gloo group rebuilt in the same processes.

Where it sits: once the agents agree on epoch ``e`` and its sorted members, every
training process calls ``Communicator.create(store, e, members, me)``; the reducer runs
its collectives through it; on ``PeerLost`` the agents agree on ``e + 1`` and the loop
builds the next communicator in the same process. torch's default process group is never
touched: each epoch is a private ``ProcessGroupGloo`` on the store prefix
``keepstep/epoch-{e}/``.

Giving up fast: gloo reports a dead peer only to its direct neighbours; other ranks would
block until the group timeout. So collectives run asynchronously and the caller waits in
short slices while watching one store key, ``keepstep/abort/{e}``. A rank that sees a gloo
error or times out writes that key (the first reason wins) and wakes every rank's listener,
so every other rank sees it at once. The agent or a test aborts an epoch the same way
(``abort_epoch``).

Tearing down: a given-up group still has gloo threads blocked on the dead peer, and its
destructor joins them. A daemon reaper thread takes it, waits for the pending work to fail
and drops it, so ``close()`` and the next ``create()`` never wait. Until then the work is
live: if the peer it waits for was only stopped and comes back, the work completes and
writes into the tensor it was handed, after ``PeerLost`` was raised. So a caller must not
reuse a tensor whose collective raised ``PeerLost`` (the reducers take a fresh buffer).
No Python callback is ever attached to gloo work: one could fire while the interpreter
shuts down and kill the process (seen as ``terminate called after throwing
gloo::IoException``).
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import AllgatherOptions, PrefixStore, Store

from keepstep.elastic.comm.abort import (
    _COMPUTE_POLL_INTERVAL_S,
    _FRESH_READ_S,
    _PUSHED_POLL_INTERVAL_S,
    _AbortWatch,
    _check_epoch,
    _Outcome,
    _short,
    abort_epoch,
    abort_key,
)
from keepstep.elastic.comm.reap import reap
from keepstep.elastic.errors import ConfigError, PeerLost

__all__ = ["Communicator", "abort_epoch", "abort_key"]

_REAP_GRACE_S = 5.0  # beyond the op timeout, after which a reaper drops the group anyway


@dataclass(frozen=True)
class _Spec:
    """What every member of an epoch agrees on, validated before anything connects."""

    epoch: int
    members: tuple[str, ...]
    me: str
    timeout: timedelta
    host: str

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        names = self.members
        if not names:
            raise ConfigError("members must not be empty")
        if not all(isinstance(name, str) and name for name in names):
            raise ConfigError(f"every member must be a non-empty str, got {list(names)!r}")
        if list(names) != sorted(set(names)):
            raise ConfigError(f"members must be sorted and unique, got {list(names)!r}")
        if self.me not in names:
            raise ConfigError(f"me={self.me!r} is not one of members {list(names)!r}")
        _check_timeout(self.timeout)
        if not self.host:
            raise ConfigError("host must be a non-empty address or hostname, got ''")

    @property
    def rank(self) -> int:
        return self.members.index(self.me)


def _work_ready(work: Any) -> Callable[[int], bool]:
    def ready(slice_ms: int) -> bool:
        try:
            work.wait(timedelta(milliseconds=slice_ms))
        except RuntimeError:
            pass  # the slice ran out, or the work failed: is_completed() tells which
        return bool(work.is_completed())

    return ready


def _new_gloo_group(store: Store, spec: _Spec) -> Any:
    # The stubs declare `Options.devices`; the runtime class is `_Options` with `_devices`
    # (what distributed_c10d uses itself), hence Any.
    gloo = cast(Any, dist.ProcessGroupGloo)
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname=spec.host)]
    opts._timeout = spec.timeout
    # Each group rendezvouses over its own store connection: the group of an abandoned
    # epoch can still be blocked in a store wait for a dead member, and on a shared
    # connection that wait would hold up the next epoch's rendezvous until it times out.
    try:
        own = store.clone()
    except (RuntimeError, NotImplementedError):
        own = store
    prefixed = PrefixStore(f"keepstep/epoch-{spec.epoch}/", own)
    return gloo(prefixed, spec.rank, len(spec.members), opts)


def _build_group(store: Store, spec: _Spec) -> tuple[Any, _AbortWatch]:
    # The constructor blocks until every member connected; run it off-thread so an abort
    # (a member died before joining) is heard at once, not after `timeout`.
    box: list[Any] = []
    errors: list[Exception] = []
    built = threading.Event()

    def build() -> None:
        try:
            box.append(_new_gloo_group(store, spec))
        except Exception as err:
            errors.append(err)
        finally:
            built.set()

    threading.Thread(target=build, name=f"keepstep-build-{spec.epoch}", daemon=True).start()
    deadline = time.monotonic() + spec.timeout.total_seconds()
    # Its connections open while the group connects.
    watch = _AbortWatch(store, spec.epoch, spec.rank, len(spec.members))
    outcome = watch.wait(lambda ms: built.wait(ms / 1000), deadline, threading.Event())
    if outcome is _Outcome.DONE and box:
        return box[0], watch
    if outcome is _Outcome.ABORTED:
        reason = cast(str, watch.reason)
    else:
        why = f"failed: {_short(errors[0])}" if errors else f"timed out after {spec.timeout}"
        reason = watch.fire(f"rank {spec.rank}: building the group {why}")
    watch.close()  # its threads end and their connections close
    raise PeerLost(spec.epoch, reason)


class Communicator:
    """Collectives among the members of one epoch; build with ``create``, end with ``close``.

    A collective either completes or raises ``PeerLost``, which is latched: every later
    call raises it too. Use it from one thread; ``close`` may come from any thread.
    """

    def __init__(
        self, spec: _Spec, watch: _AbortWatch, group: Any | None, build_seconds: float
    ) -> None:
        self.epoch: int = spec.epoch
        self.members: tuple[str, ...] = spec.members
        self.me: str = spec.me
        self.rank: int = spec.rank
        self.size: int = len(spec.members)
        self.build_seconds: float = build_seconds
        self._timeout = spec.timeout
        self._watch = watch
        self._group = group
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
    ) -> Communicator:
        """Build the group of ``epoch``; every member calls this with the same arguments.

        Blocks until all members joined; ``PeerLost`` if ``timeout`` passes first or the
        epoch is aborted. ``timeout`` is also every collective's default timeout.
        """
        start = time.perf_counter()
        spec = _Spec(epoch, tuple(members), me, timeout, host)
        if len(spec.members) > 1:
            group, watch = _build_group(store, spec)
        else:
            group, watch = None, _AbortWatch(store, epoch, 0, 1)
        # Aborted before or while we built: fail now, not at the first collective.
        if watch.poll(_FRESH_READ_S) is not None:
            if group is not None:
                reap(epoch, group, None, 0.0)
            watch.close()
            raise PeerLost(epoch, cast(str, watch.reason))
        return cls(spec, watch, group, time.perf_counter() - start)

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

    def allgather_object(self, obj: object, timeout: timedelta | None = None) -> list[object]:
        """Every member's ``obj`` in rank order; for small metadata from trusted peers (the
        bytes are unpickled)."""
        payload = pickle.dumps(obj)
        if self.size == 1:
            self._collective("allgather_object", None, None, timeout)
            return [pickle.loads(payload)]
        # One deadline for both rounds, so the call as a whole honours `timeout`.
        deadline = time.monotonic() + self._op_timeout(timeout).total_seconds()
        sizes = torch.zeros(self.size, dtype=torch.int64)
        sizes[self.rank] = len(payload)
        self.allreduce(sizes, dist.ReduceOp.SUM, _left(deadline))
        mine = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        slots = [torch.empty_like(mine) for _ in range(self.size)]
        gather = lambda g, o: g.allgather([slots], [mine], o)  # noqa: E731
        self._collective("allgather_object", AllgatherOptions(), gather, _left(deadline))
        lengths = sizes.tolist()
        return [pickle.loads(s[:n].numpy().tobytes()) for s, n in zip(slots, lengths, strict=True)]

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
        if wait:
            return self._watch.poll(_FRESH_READ_S) is not None
        every = _PUSHED_POLL_INTERVAL_S if self._watch.pushed else _COMPUTE_POLL_INTERVAL_S
        return self._watch.poll(every=every) is not None

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
            reap(self.epoch, group, work, self._timeout.total_seconds() + _REAP_GRACE_S)

    def _op_timeout(self, timeout: timedelta | None) -> timedelta:
        if timeout is None:
            return self._timeout
        _check_timeout(timeout)
        return timeout

    def _give_up(self, reason: str, work: Any | None) -> PeerLost:
        if self._lost is None:
            self._lost = reason
        self._retire(work)
        return PeerLost(self.epoch, self._lost)

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
            self.size == 1 and self._watch.poll(_FRESH_READ_S) is not None
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
            raise self._give_up(self._watch.fire(f"{who} failed: {_short(err)}"), None) from err
        deadline = time.monotonic() + op_timeout.total_seconds()
        self._inflight = work
        try:
            outcome = self._watch.wait(_work_ready(work), deadline, self._closed)
        finally:
            self._inflight = None
        if outcome is _Outcome.CLOSED:
            raise PeerLost(self.epoch, self._lost or "communicator closed")
        if outcome is _Outcome.ABORTED:
            raise self._give_up(cast(str, self._watch.reason), work)
        if outcome is _Outcome.TIMED_OUT:
            reason = f"{who} timed out after {op_timeout.total_seconds():g} s"
            raise self._give_up(self._watch.fire(reason), work)
        try:
            work.wait()  # completed: returns at once, or raises the gloo error
        except RuntimeError as err:
            raise self._give_up(self._watch.fire(f"{who} failed: {_short(err)}"), work) from err


def _left(deadline: float) -> timedelta:
    # At least a millisecond: a spent deadline should time the next round out, not be
    # refused as an invalid timeout.
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _check_timeout(timeout: timedelta) -> None:
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ConfigError(f"timeout must be a positive timedelta, got {timeout!r}")


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ConfigError(
            f"{what} needs a dense CPU tensor, got {tensor.layout} on {tensor.device}"
        )
    if not tensor.is_contiguous():
        raise ConfigError(f"{what} needs a contiguous tensor; call .contiguous() first")
