"""Snapshots of device tensors: the slot memory pinned for the GPU, the copy on a side stream.

Where it sits: ``CopyJob`` (snapshot_write.py) copies a commit's tensors into a slot on the
store's copy thread, through a ``DeviceCopier`` the store keeps for its life. CPU tensors
are copied as they always were (one batched copy). CUDA tensors go this way:

- at the commit, on the caller's thread, ``mark`` records an event on each source device's
  current stream: the copy reads what the step queued before the commit, and waits for
  nothing queued after it;
- on the copy thread, the buffer's mapping is page-locked with ``cudaHostRegister`` once
  (``Pinning``), and again only when the store grows the buffer (a new mapping). A copy into
  page-locked memory runs at the copy engines' speed; into pageable memory the driver
  stages it through its own buffers at a quarter of that (bench/gpu_check.py);
- every copy is queued on a side stream behind that event and the thread waits once for
  them all; the checksum then runs on the host over the copied bytes.

The main stream goes on with the next step's forward and backward meanwhile. The Job waits
for the copy (``SnapshotStore.wait``) before the optimizer step changes the tensors, as on
the CPU, and clones at the commit the buffers a forward changes (``Job._snapshot``), so the
side stream reads tensors nobody writes while it runs.

A mapping that cannot be page-locked (a memlock limit, a driver that refuses) is copied to
as pageable memory: slower, the same bytes; the reason is logged once per mapping. CUDA
keeps a failed call's error as the thread's "last error", which a later kernel launch check
would raise as its own; registration therefore runs on a short-lived thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: page-locked for every CUDA context of the process.
_PORTABLE = 1
# A registration (pinning every page of the mapping) or its release may take seconds for
# tens of GB; past this the thread is left to finish alone and the copy goes pageable.
REGISTER_TIMEOUT_S = 120.0


class HostMemory(Protocol):
    """Page-locks host memory for the device (cudaHostRegister); a fake in unit tests.
    Both calls raise OSError with the driver's reason on failure."""

    def register(self, ptr: int, size: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaHostMemory:
    """``HostMemory`` through the CUDA runtime torch itself loaded."""

    def register(self, ptr: int, size: int) -> None:
        _check("cudaHostRegister", _cudart().cudaHostRegister(ptr, size, _PORTABLE))

    def unregister(self, ptr: int) -> None:
        _check("cudaHostUnregister", _cudart().cudaHostUnregister(ptr))


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _check(call: str, result: Any) -> None:
    code = int(result)  # a pybind11 enum of cudaError_t
    if code != 0:
        raise OSError(f"{call}: CUDA error {code} ({_cudart().cudaGetErrorString(result)})")


def _own_thread(fn: Callable[[], None], timeout: float) -> None:
    """Run ``fn`` on a new thread and re-raise what it raised (see the module docstring)."""
    failed: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the caller
            failed.append(e)

    thread = threading.Thread(target=body, name="keepstep-pin", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise OSError(f"still running after {timeout} s")
    if failed:
        raise failed[0]


class Pinning:
    """Which buffer mapping is page-locked: the one the last ``ensure`` saw.

    Holds a reference to that mapping (an mmap, a bytearray) until it unregisters it, so the
    memory is not unmapped while the device may still write it. Used from the copy thread;
    ``release`` from the store's thread once the copy thread is idle.
    """

    def __init__(self, host: HostMemory, timeout: float = REGISTER_TIMEOUT_S) -> None:
        self._host, self._timeout = host, timeout
        self._obj: object = None  # the mapping last seen, pinned or not
        self._ptr, self._size, self.pinned = 0, 0, False

    def ensure(self, view: memoryview) -> bool:
        """Page-lock the mapping behind ``view`` (a whole buffer's view) unless it already
        is; unregister the previous one first. True if it is page-locked."""
        if view.obj is self._obj:
            return self.pinned
        self.release()
        self._obj = view.obj
        if len(view) == 0:
            return False
        probe = torch.frombuffer(view, dtype=torch.uint8)
        ptr, size = probe.data_ptr(), len(view)
        del probe
        t0 = time.perf_counter()
        try:
            _own_thread(lambda: self._host.register(ptr, size), self._timeout)
        except OSError as e:
            log.warning("snapshot slots stay pageable (device copies run slower): %s", e)
            return False
        self._ptr, self._size, self.pinned = ptr, size, True
        log.info("snapshot slots page-locked: %d B in %.3f s", size, time.perf_counter() - t0)
        return True

    def release(self) -> None:
        """Unregister the pinned mapping (if any) and let it go."""
        if self.pinned:
            ptr = self._ptr
            try:
                _own_thread(lambda: self._host.unregister(ptr), self._timeout)
            except OSError as e:
                log.warning("snapshot slots: unregistering %d B failed: %s", self._size, e)
        self._obj, self._ptr, self._size, self.pinned = None, 0, 0, False


class Ready:
    """The events a commit recorded: one per CUDA device among its sources."""

    __slots__ = ("events",)

    def __init__(self, events: dict[torch.device, torch.cuda.Event]) -> None:
        self.events = events


class DeviceCopier:
    """A store's copies of device tensors (see the module docstring); CPU ones pass through.

    ``host`` is how memory is page-locked (default: the CUDA runtime, used only once a
    commit has CUDA tensors); ``pin=False`` copies to pageable memory (for comparisons).
    """

    def __init__(self, host: HostMemory | None = None, *, pin: bool = True) -> None:
        self.pinning = Pinning(host if host is not None else CudaHostMemory())
        self._pin = pin
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def mark(tensors: Sequence[torch.Tensor]) -> Ready | None:
        """On the committing thread: an event per CUDA device the tensors live on, recorded on
        its current stream; None when all are on the CPU."""
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        if not devices:
            return None
        events = {}
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        return Ready(events)

    def copy(
        self,
        whole: memoryview,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        ready: Ready | None,
    ) -> None:
        """On the copy thread: dsts[i] = srcs[i]; the dsts lie in the buffer ``whole`` views.
        Returns once every byte is on the host."""
        if ready is None:
            torch._foreach_copy_(list(dsts), list(srcs))  # one call, not a copy_ per tensor
            return
        by_device: dict[torch.device, list[int]] = {}
        for i, src in enumerate(srcs):
            by_device.setdefault(src.device, []).append(i)
        if self._pin:
            self.pinning.ensure(whole)
        done = []
        for device, index in by_device.items():
            if device.type != "cuda":
                torch._foreach_copy_([dsts[i] for i in index], [srcs[i] for i in index])
                continue
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            with torch.cuda.stream(stream):
                stream.wait_event(ready.events[device])
                for i in index:
                    dsts[i].copy_(srcs[i], non_blocking=True)
                finished = torch.cuda.Event()  # type: ignore[no-untyped-call]
                finished.record(stream)
            done.append(finished)
        for finished in done:
            finished.synchronize()

    def release(self) -> None:
        """Unregister the pinned mapping; the store calls this once its copy thread is idle."""
        self.pinning.release()
