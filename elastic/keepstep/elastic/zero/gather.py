"""The collectives ZeRO-1 needs: all-gather and all-to-all of byte buffers, behind a seam.

Where it sits: ``ZeroOptimizer`` (zero/optimizer.py) all-gathers the updated parameters
after every step and, on request, the optimizer state; Muon's whole-matrix step sends
each matrix's pieces to the one rank that steps it (an all-to-all). It talks to a
``Gather``: a rank, a size, the device its buffers live on, ``allgather`` of
equal-length tensors and ``alltoall`` of byte buffers, each with a timeout.
``GroupGather`` is that over a torch.distributed process group (gloo: CPU buffers, or
CUDA ones it stages); ``LocalGathers`` is the in-memory fake beside it, ranks on threads
of one process, for fast tests (and for gpu_check, ranks sharing one GPU). ``CommGather``
is that over the job's ``Communicator`` (its abort handling then covers these
collectives too), on its device (the GPU of an NCCL epoch), receiving into one buffer it
keeps there.

Everything is gathered as uint8: parameters of mixed dtypes travel in one collective, and
bytes are copied, never converted, so nothing can round on the way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions

from keepstep.elastic.comm.rounds import Alloc, Buffers, same_device
from keepstep.elastic.errors import BadMessage, ConfigError, PeerLost

T = TypeVar("T")

__all__ = [
    "CommGather",
    "Gather",
    "GroupGather",
    "LocalGathers",
    "TensorCollective",
    "allgather_ragged",
]


class Gather(Protocol):
    """All-gather among the ranks of one membership epoch."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where ``allgather``'s tensors must live (gloo: the CPU)."""
        ...

    def allgather(self, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        """Every rank's ``mine`` (same shape and dtype on all ranks), in rank order.
        Raises ``PeerLost`` if a rank fails or ``timeout`` passes."""
        ...

    def alltoall(
        self, sends: Sequence[torch.Tensor], max_bytes: int, timeout: timedelta
    ) -> list[torch.Tensor]:
        """``sends[d]`` (1-D uint8 on ``device``, at most ``max_bytes``; empty: nothing) to
        rank d; what every rank sent here, in rank order (views valid until the next
        call). ``BadMessage`` for a longer one; ``PeerLost`` as ``allgather``."""
        ...


class TensorCollective(Protocol):
    """What ``CommGather`` needs of the epoch's ``Communicator`` (its public methods)."""

    rank: int
    size: int
    members: tuple[str, ...]
    device: torch.device

    def allgather(
        self,
        tensor: torch.Tensor,
        timeout: timedelta | None = None,
        into: Alloc | None = None,
    ) -> list[torch.Tensor]: ...

    def alltoall_tensors(
        self,
        payloads: Sequence[torch.Tensor],
        max_bytes: int,
        timeout: timedelta | None = None,
        into: Alloc | None = None,
    ) -> list[torch.Tensor]: ...


class CommGather:
    """``zero.Gather`` over ``Communicator.allgather``: the epoch's abort handling
    (``PeerLost``, the abort key) covers ZeRO's all-gathers too. Tensors travel as their
    raw bytes (never converted, never pickled) and come back with the sender's shape and
    dtype, which every rank shares by the Gather contract (checked by length). Make one
    per epoch: it receives into the same buffer gather after gather, and a gather given up
    may still write into it (the returned tensors are views of it, valid until the next)."""

    def __init__(self, comm: TensorCollective) -> None:
        self.comm = comm
        buffers = Buffers()
        self._into = buffers.alloc("slots", comm.device)  # kept: later gathers write it warm
        self._inbox = buffers.alloc("inbox", comm.device)  # the same for the all-to-alls

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def device(self) -> torch.device:
        return self.comm.device  # the epoch's: the CPU for gloo, the member's GPU for NCCL

    def allgather(self, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        _check(mine, self.device)
        raw = mine.detach().contiguous().reshape(-1).view(torch.uint8)
        slots = self.comm.allgather(raw, timeout, into=self._into)
        out = []
        for rank, slot in enumerate(slots):
            if slot.dtype != torch.uint8 or slot.shape != raw.shape:
                got = f"{slot.numel()} {str(slot.dtype).removeprefix('torch.')}"
                raise BadMessage(f"rank {rank} sent {got} values, {raw.numel()} bytes expected")
            out.append(slot.view(mine.dtype).reshape(mine.shape))
        return out

    def alltoall(
        self, sends: Sequence[torch.Tensor], max_bytes: int, timeout: timedelta
    ) -> list[torch.Tensor]:
        _check_sends(sends, self.size, self.device)
        return self.comm.alltoall_tensors(list(sends), max_bytes, timeout, into=self._inbox)


class GroupGather:
    """``Gather`` over a torch.distributed process group object (``ProcessGroupGloo``:
    CPU tensors, or CUDA tensors it stages through the host, on ``device``)."""

    def __init__(self, group: Any, epoch: int = 0, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.epoch = epoch
        self._device = torch.device(device)
        self._rank = int(group.rank())
        self._size = int(group.size())

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    def allgather(self, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        _check(mine, self.device)
        if self._size == 1:
            return [mine.clone()]
        slots = [torch.empty_like(mine) for _ in range(self._size)]
        opts = AllgatherOptions()
        opts.timeout = timeout
        try:
            self.group.allgather([slots], [mine], opts).wait(timeout)
        except RuntimeError as err:
            raise PeerLost(self.epoch, f"rank {self._rank}: allgather failed: {err}") from err
        return slots

    def alltoall(
        self, sends: Sequence[torch.Tensor], max_bytes: int, timeout: timedelta
    ) -> list[torch.Tensor]:
        """The lengths first (an all-gather of every rank's list), then the bytes."""
        _check_sends(sends, self._size, self.device)
        deadline = time.monotonic() + timeout.total_seconds()
        mine = torch.tensor([s.numel() for s in sends], dtype=torch.int64, device=self.device)
        table = self.allgather(mine, timeout)
        lengths = [int(row[self._rank]) for row in table]
        _check_lengths(lengths, max_bytes)
        if self._size == 1:
            return [sends[0].clone()]
        out = torch.empty(sum(lengths), dtype=torch.uint8, device=self.device)
        opts = AllToAllOptions()
        opts.timeout = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        data = (
            torch.cat(list(sends))
            if any(s.numel() for s in sends)
            else torch.empty(0, dtype=torch.uint8, device=self.device)
        )
        sizes = [s.numel() for s in sends]
        try:
            self.group.alltoall_base(out, data, lengths, sizes, opts).wait(opts.timeout)
        except RuntimeError as err:
            raise PeerLost(self.epoch, f"rank {self._rank}: alltoall failed: {err}") from err
        return list(torch.split(out, lengths))


class LocalGathers:
    """The in-memory fake: ``world`` ranks of one process, each calling from its own thread.

    ``LocalGathers(3).rank(r)`` is rank r's ``Gather``. A rank that does not arrive within
    the timeout breaks the round for all (``PeerLost``), as a lost peer would. The ranks'
    tensors live on ``device`` (several ranks may share one GPU: gpu_check runs them so).
    """

    def __init__(self, world: int, device: torch.device | str = "cpu") -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ConfigError(f"world={world!r} must be an int >= 1")
        self.world = world
        self.device = torch.device(device)
        self._slots: list[torch.Tensor | None] = [None] * world
        self._mail: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self._barrier = threading.Barrier(world)

    def rank(self, rank: int) -> _LocalGather:
        if not 0 <= rank < self.world:
            raise ConfigError(f"rank={rank!r} must be in [0, {self.world})")
        return _LocalGather(self, rank)

    def run(self, member: Callable[[int, Gather], T], timeout: timedelta) -> list[T]:
        """``member(rank, gather)`` for every rank, each on its own thread; what each
        returned, in rank order. The first error is raised again (the other ranks are
        released from their gather at once); a rank still running after ``timeout``
        raises ``TimeoutError``."""
        out: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                out[rank] = member(rank, self.rank(rank))
            except BaseException as err:
                errors.append(err)
                self.abort()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(self.world)]
        deadline = time.monotonic() + timeout.total_seconds()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.0))
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"a rank of {self.world} was still running after {timeout}")
        return out

    def abort(self) -> None:
        """Break the current and every later round (``PeerLost`` on every rank): a rank
        that failed before the gather calls it, so the others stop waiting."""
        self._barrier.abort()

    def _exchange(self, rank: int, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        wait_s = timeout.total_seconds()
        try:
            self._slots[rank] = mine.clone()
            self._barrier.wait(wait_s)  # every slot is written
            slots = [s for s in self._slots if s is not None]
            shapes = {(tuple(s.shape), s.dtype) for s in slots}
            out = [s.clone() for s in slots]
            self._barrier.wait(wait_s)  # every rank has read: the next round may write
        except threading.BrokenBarrierError:
            raise PeerLost(0, f"rank {rank}: a local rank did not arrive") from None
        if len(shapes) != 1:
            raise ConfigError(f"allgather needs the same shape and dtype on every rank: {shapes}")
        return out

    def _post(
        self, rank: int, sends: Sequence[torch.Tensor], max_bytes: int, timeout: timedelta
    ) -> list[torch.Tensor]:
        wait_s = timeout.total_seconds()
        try:
            self._mail[rank] = [s.clone() for s in sends]
            self._barrier.wait(wait_s)  # every rank has posted
            out = [self._mail[r][rank].clone() for r in range(self.world)]
            self._barrier.wait(wait_s)  # every rank has read: the next round may post
        except threading.BrokenBarrierError:
            raise PeerLost(0, f"rank {rank}: a local rank did not arrive") from None
        _check_lengths([t.numel() for t in out], max_bytes)
        return out


class _LocalGather:
    def __init__(self, hub: LocalGathers, rank: int) -> None:
        self._hub = hub
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._hub.world

    @property
    def device(self) -> torch.device:
        return self._hub.device

    def allgather(self, mine: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
        _check(mine, self.device)
        return self._hub._exchange(self._rank, mine, timeout)

    def alltoall(
        self, sends: Sequence[torch.Tensor], max_bytes: int, timeout: timedelta
    ) -> list[torch.Tensor]:
        _check_sends(sends, self._hub.world, self.device)
        return self._hub._post(self._rank, sends, max_bytes, timeout)


def allgather_ragged(
    gather: Gather, mine: torch.Tensor, timeout: timedelta, max_bytes: int
) -> list[torch.Tensor]:
    """Every rank's 1-D uint8 ``mine`` (of any length up to ``max_bytes``), in rank order,
    copies of their own: the lengths, then the buffers padded to the longest, under one
    deadline."""
    deadline = time.monotonic() + timeout.total_seconds()
    n = torch.tensor([mine.numel()], dtype=torch.int64, device=gather.device)
    lengths = [int(x) for x in gather.allgather(n, timeout)]
    for rank, length in enumerate(lengths):
        if not 0 <= length <= max_bytes:
            raise BadMessage(f"rank {rank} sent {length} bytes; at most {max_bytes} expected")
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=gather.device)
    padded[: mine.numel()] = mine
    left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    slots = gather.allgather(padded, left)  # a gather's own buffer, perhaps, until the next
    return [s[:length].clone() for s, length in zip(slots, lengths, strict=True)]


def _check_sends(sends: Sequence[torch.Tensor], world: int, device: torch.device) -> None:
    if len(sends) != world:
        raise ConfigError(f"alltoall needs one buffer per rank: {len(sends)} for {world}")
    for d, s in enumerate(sends):
        if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8 or s.dim() != 1:
            raise ConfigError(f"alltoall sends 1-D uint8 buffers; the one to rank {d} is not")
        _check(s, device)


def _check_lengths(lengths: Sequence[int], max_bytes: int) -> None:
    for rank, length in enumerate(lengths):
        if not 0 <= length <= max_bytes:
            raise BadMessage(f"rank {rank} sent {length} bytes; at most {max_bytes} expected")


def _check(mine: torch.Tensor, device: torch.device) -> None:
    if (
        not isinstance(mine, torch.Tensor)
        or not same_device(mine.device, device)
        or not mine.is_contiguous()
    ):
        got = mine.device if isinstance(mine, torch.Tensor) else type(mine).__name__
        raise ConfigError(f"allgather needs a contiguous tensor on {device}, got {got}")
