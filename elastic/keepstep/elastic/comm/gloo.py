"""The gloo transport: CPU tensors, one private ``ProcessGroupGloo`` per epoch.

Where it sits: behind the seam of transport.py, chosen for CPU tensors. `Communicator`
(communicator.py) asks `GlooTransport.connect` for the epoch's `GlooLink` on the build
thread of group.py, starts collectives on it and waits on each `GlooPending` in slices.

torch's default process group is never touched: each epoch is a private group on the store
prefix ``keepstep/epoch-{e}/``. gloo cannot be interrupted from another thread: work waits
until its own timeout (set to the collective's) or until the group is dropped, so
``interrupt`` does nothing and a retired group goes to the process's reaper (reap.py),
which drops it once its work is over. No Python callback is ever attached to gloo work:
one could fire while the interpreter shuts down and kill the process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import AllgatherOptions, Store

from keepstep.elastic.comm.group import EpochSpec, own_prefix
from keepstep.elastic.comm.reap import Reaper
from keepstep.elastic.comm.transport import Backend, Pending, check_dense

REAP_GRACE_S = 5.0  # beyond the op timeout, after which a reaper drops the group anyway
# From this size on an allgather runs as one alltoall per peer (GlooLink.allgather):
# gloo's own allgather moved 22 MB a rank between 2 ranks in ~55 ms, the alltoalls in
# ~15 ms (10.8 MB among 4: ~90 against ~32 ms); below it, gloo's has fewer rounds.
ALLGATHER_ROUNDS_BYTES = 1 << 16
_CPU = torch.device("cpu")


class GlooPending:
    """One gloo collective in flight (one work, or the alltoalls that make an allgather);
    it holds its tensors as long as it lives, and tells ``link`` once it is seen over."""

    def __init__(
        self, work: Any | Sequence[Any], tensors: tuple[object, ...], link: GlooLink
    ) -> None:
        self._works = list(work) if isinstance(work, Sequence) else [work]
        self._tensors = tensors  # buffers stay referenced while the work may write them
        self._link: GlooLink | None = link  # None once the work was seen over
        link.in_flight += 1

    def ready(self, slice_ms: int) -> bool:
        end = time.monotonic() + slice_ms / 1000
        for work in self._works:
            left_ms = int((end - time.monotonic()) * 1000)
            if left_ms < 1:
                break
            try:
                work.wait(timedelta(milliseconds=left_ms))
            except RuntimeError:
                pass  # the slice ran out, or the work failed: is_completed() tells which
        return self.is_completed()

    def is_completed(self) -> bool:
        done = all(work.is_completed() for work in self._works)
        if done and self._link is not None:
            self._link.in_flight -= 1
            self._link = None
        return done

    def result(self) -> None:
        for work in self._works:
            work.wait()  # completed: returns at once, or raises the gloo error


class GlooLink:
    """The gloo group of one epoch (see the module)."""

    def __init__(self, group: Any, epoch: int, reaper: Reaper, bound_s: float) -> None:
        self._group: Any | None = group
        self._epoch = epoch
        self._reaper = reaper
        self._bound_s = bound_s
        self.in_flight = 0  # collectives started and not yet seen over (GlooPending)
        reaper.track(self)

    @property
    def raw(self) -> object:
        return self._group

    def _live(self) -> Any:
        if self._group is None:
            raise RuntimeError("the group was retired")
        return self._group

    def allreduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout: timedelta
    ) -> Pending:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timeout  # gloo gives up on its own at the same deadline
        return GlooPending(self._live().allreduce([tensor], opts), (tensor,), self)

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta) -> Pending:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = timeout
        return GlooPending(self._live().broadcast([tensor], opts), (tensor,), self)

    def allgather(
        self, slots: list[torch.Tensor], mine: torch.Tensor, timeout: timedelta
    ) -> Pending:
        """From ``ALLGATHER_ROUNDS_BYTES`` on, as ``size - 1`` alltoalls in which each rank
        sends ``mine`` to one peer, the k-th to rank + k, and receives straight into the
        slot of rank - k (no scratch: the other splits are empty)."""
        opts = AllgatherOptions()
        opts.timeout = timeout
        group = self._live()
        size = len(slots)
        if size < 2 or mine.numel() * mine.element_size() < ALLGATHER_ROUNDS_BYTES:
            return GlooPending(group.allgather([slots], [mine], opts), (slots, mine), self)
        rank = int(group.rank())
        flat = mine.reshape(-1)
        n = flat.numel()
        slots[rank].copy_(mine)
        a2a = dist.AllToAllOptions()
        a2a.timeout = timeout
        works = []
        for k in range(1, size):
            sends, gets = [0] * size, [0] * size
            sends[(rank + k) % size] = gets[(rank - k) % size] = n
            into = slots[(rank - k) % size].view(-1)
            works.append(group.alltoall_base(into, flat, gets, sends, a2a))
        return GlooPending(works, (slots, mine), self)

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
        work = self._live().alltoall_base(out, mine, out_splits, in_splits, opts)
        return GlooPending(work, (out, mine), self)

    def barrier(self, timeout: timedelta) -> Pending:
        opts = dist.BarrierOptions()
        opts.timeout = timeout
        return GlooPending(self._live().barrier(opts), (), self)

    def interrupt(self) -> None:
        """Nothing to do: gloo work ends at its own timeout, or when the reaper drops it."""

    def retire(self, pending: Pending | None) -> None:
        group, self._group = self._group, None
        if group is not None:
            self._reaper.reap(self._epoch, group, pending, self._bound_s)

    def drop_if_idle(self) -> bool:
        """At exit (``Reaper.drop_idle``): drop the group here unless a collective of it
        may still run; its destructor joins gloo's threads (see reap.py)."""
        if self._group is None or self.in_flight:
            return False
        group, self._group = self._group, None
        del group  # the last reference, unless a test holds one
        return True


class GlooTransport:
    """Dense CPU tensors over a private gloo group per epoch."""

    def __init__(self, reaper: Reaper) -> None:
        self._reaper = reaper

    @property
    def backend(self) -> Backend:
        return Backend.GLOO

    @property
    def device(self) -> torch.device:
        return _CPU

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        check_dense(tensor, what, _CPU)

    def connect(self, store: Store, spec: EpochSpec) -> GlooLink:
        bound_s = spec.timeout.total_seconds() + REAP_GRACE_S
        return GlooLink(_new_gloo_group(store, spec), spec.epoch, self._reaper, bound_s)


def _new_gloo_group(store: Store, spec: EpochSpec) -> Any:
    # The stubs declare `Options.devices`; the runtime class is `_Options` with `_devices`
    # (what distributed_c10d uses itself), hence Any.
    gloo = cast(Any, dist.ProcessGroupGloo)
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname=spec.host)]
    opts._timeout = spec.timeout
    return gloo(own_prefix(store, spec.epoch), spec.rank, spec.size, opts)
