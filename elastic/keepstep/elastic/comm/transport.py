"""The seam between an epoch's logic and the library that moves the bytes (gloo or NCCL).

Where it sits: `Communicator` (communicator.py) owns an epoch: its abort key and listener,
the waits in slices, the ``PeerLost`` latch, handing retired groups to the reaper. What
differs per backend is behind the three small protocols here:

    Transport  one per communicator: checks tensors, builds the epoch's `Link` (blocking;
               it runs on the build thread of group.py while the caller waits on the watch)
    Link       the connected group of one epoch: starts collectives, is interrupted from
               another thread, retires its group (holding buffers until their work ends)
    Pending    one collective in flight: waited on in slices, then its error read

gloo.py and nccl.py implement them; `select_backend` says which one a device gets.
"""

from __future__ import annotations

import enum
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import Store

from keepstep.elastic.errors import ConfigError

if TYPE_CHECKING:
    from keepstep.elastic.comm.group import EpochSpec


class Backend(enum.Enum):
    """Which library carries an epoch's collectives."""

    GLOO = "gloo"  # CPU tensors
    NCCL = "nccl"  # CUDA tensors of one device


def select_backend(device: torch.device | str | None, backend: Backend | str | None) -> Backend:
    """The backend for collectives on ``device`` (``None``: the CPU), or ``backend`` if given.

    cpu -> gloo, cuda -> nccl. An explicit backend must suit the device: gloo here takes
    CPU tensors only and NCCL CUDA tensors only.
    """
    kind = _device_type(device)
    if backend is None:
        chosen = Backend.NCCL if kind == "cuda" else Backend.GLOO
    else:
        chosen = _backend(backend)
    wanted = "cuda" if chosen is Backend.NCCL else "cpu"
    if kind != wanted:
        raise ConfigError(
            f"backend {chosen.value} takes {wanted} tensors, but the device is {kind!r}; "
            f"allowed: device 'cpu' with gloo, device 'cuda[:N]' with nccl"
        )
    return chosen


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from err
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return kind


def _backend(backend: Backend | str) -> Backend:
    if isinstance(backend, Backend):
        return backend
    try:
        return Backend(backend)
    except ValueError:
        allowed = [b.value for b in Backend]
        raise ConfigError(f"backend must be one of {allowed}, got {backend!r}") from None


def check_dense(tensor: torch.Tensor, what: str, device: torch.device) -> None:
    """ConfigError unless ``tensor`` is a dense, contiguous tensor on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    kind = "CPU" if device.type == "cpu" else str(device)
    if tensor.device != device or tensor.layout != torch.strided:
        hint = ""
        if tensor.device.type == "cuda" and device.type == "cpu":
            hint = (
                " (CUDA tensors need the NCCL transport: create the communicator on a cuda device)"
            )
        raise ConfigError(
            f"{what} needs a dense {kind} tensor, got {tensor.layout} on {tensor.device}{hint}"
        )
    if not tensor.is_contiguous():
        raise ConfigError(f"{what} needs a contiguous tensor; call .contiguous() first")


class Pending(Protocol):
    """One collective in flight. It keeps the tensors it was handed until it is dropped."""

    def ready(self, slice_ms: int) -> bool:
        """Wait at most ``slice_ms`` (>= 1); True once the work is over, well or not."""
        ...

    def is_completed(self) -> bool:
        """True once the work is over; never blocks (the reaper polls it)."""
        ...

    def result(self) -> None:
        """Once over: return if it succeeded, raise its RuntimeError if it failed."""
        ...


class Link(Protocol):
    """The connected group of one epoch, used from one thread but ``interrupt``."""

    @property
    def raw(self) -> object:
        """The library's group object (for tests that act as a peer outside keepstep)."""
        ...

    def allreduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout: timedelta
    ) -> Pending: ...

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: timedelta) -> Pending: ...

    def allgather(
        self, slots: list[torch.Tensor], mine: torch.Tensor, timeout: timedelta
    ) -> Pending: ...

    def alltoall(
        self,
        out: torch.Tensor,
        mine: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        timeout: timedelta,
    ) -> Pending:
        """Rank r's ``mine[sum(in_splits[:d]) : ...]`` to rank d, which receives it at its
        ``out[sum(out_splits[:r]) : ...]`` (1-D tensors)."""
        ...

    def barrier(self, timeout: timedelta) -> Pending: ...

    def interrupt(self) -> None:
        """Make work in flight end now; from any thread, idempotent, never blocks."""
        ...

    def retire(self, pending: Pending | None) -> None:
        """Give the group up without waiting: it (and ``pending``'s buffers) stay alive
        until ``pending`` is over, then go. Idempotent; from any thread."""
        ...


class Transport(Protocol):
    """What one communicator needs of its backend before and while it connects."""

    @property
    def backend(self) -> Backend: ...

    @property
    def device(self) -> torch.device:
        """Where this transport's tensors live (and its scratch tensors are made)."""
        ...

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        """ConfigError naming the problem unless ``tensor`` can go through this backend."""
        ...

    def connect(self, store: Store, spec: EpochSpec) -> Link:
        """Build and connect the group of one epoch; blocks until every member joined or
        raises. Runs on a thread of its own (group.py): the caller waits on the watch."""
        ...
