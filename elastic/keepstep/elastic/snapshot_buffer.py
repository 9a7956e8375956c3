"""The memory a snapshot store writes into: a Protocol and its two implementations.

Where it sits: at the bottom of the snapshot flow. The node agent creates a ``FileBuffer``
under /dev/shm (``SHM_DIR``) so that a crashed worker loses nothing; the worker's
``SnapshotStore`` (snapshot_store.py) lays slots out in it (snapshot_layout.py) and a restarted
worker or the agent opens the same file to load. ``MemoryBuffer`` is the in-process fake
for unit tests and single-process runs. A buffer only grows: another process may have it
mapped, and shrinking a mapped file would kill that process with SIGBUS.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Protocol

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt

SHM_DIR = Path("/dev/shm")


class SnapshotBuffer(Protocol):
    """The memory a store writes into.

    A store keeps tensors over a view between commits (snapshot_write.SlotViews) and drops
    them before it resizes the buffer or closes; while they live, the object behind the
    view must keep its memory where it is: grow by replacing the object (a new array, a new
    mapping), never by moving it in place. ``view().obj`` tells the store which one it has.
    """

    def view(self) -> memoryview: ...

    @property
    def size(self) -> int: ...

    def resize(self, size: int) -> None: ...

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the buffer's bytes from ``offset`` on (SnapshotCorrupt if the
        buffer ends first)."""

    def close(self) -> None: ...


class MemoryBuffer:
    """A private bytearray: for unit tests and single-process use."""

    def __init__(self, size: int = 0) -> None:
        _check_size(size, minimum=0)
        self._data = bytearray(size)

    def view(self) -> memoryview:
        return memoryview(self._data)

    @property
    def size(self) -> int:
        return len(self._data)

    def resize(self, size: int) -> None:
        _check_size(size, minimum=len(self._data))
        # A new array instead of growing in place: a view still held elsewhere keeps the
        # old one alive rather than making the resize fail with BufferError.
        grown = bytearray(size)
        grown[: len(self._data)] = self._data
        self._data = grown

    def read_into(self, offset: int, out: memoryview) -> None:
        _check_span(offset, len(out), len(self._data), "the memory buffer")
        out[:] = memoryview(self._data)[offset : offset + len(out)]

    def close(self) -> None:
        self._data = bytearray()


class FileBuffer:
    """A file mapped with mmap, by default under /dev/shm (a tmpfs), shared between processes.

    The agent creates it (``create``) and workers ``open`` it; the file outlives a crashed
    worker. multiprocessing.shared_memory is not used on purpose: Python 3.11's resource
    tracker unlinks a segment when the process that opened it exits.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._map: mmap.mmap | None = None

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        size: int = 0,
        *,
        directory: str | os.PathLike[str] = SHM_DIR,
    ) -> FileBuffer:
        """Create a new zero-filled file (FileExistsError if there is one already); a
        relative ``path`` is taken under ``directory``. A store grows it as needed."""
        _check_size(size, minimum=0)
        full = Path(directory) / path
        fd = os.open(full, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        return cls(full, fd)

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, directory: str | os.PathLike[str] = SHM_DIR
    ) -> FileBuffer:
        """Open an existing buffer (a restarted worker, or the agent reading it)."""
        full = Path(directory) / path
        return cls(full, os.open(full, os.O_RDWR))

    @classmethod
    def open_or_create(
        cls,
        path: str | os.PathLike[str],
        size: int = 0,
        *,
        directory: str | os.PathLike[str] = SHM_DIR,
    ) -> FileBuffer:
        try:
            return cls.create(path, size, directory=directory)
        except FileExistsError:
            return cls.open(path, directory=directory)

    def view(self) -> memoryview:
        size = self.size
        if size == 0:
            return memoryview(bytearray())  # mmap cannot map an empty file
        # Another process may have grown the file: map it again at its new size. The old
        # mapping is not closed here; views still using it keep it alive until they go.
        if self._map is None or len(self._map) != size:
            self._map = mmap.mmap(self._fd, size)
        return memoryview(self._map)

    @property
    def size(self) -> int:
        if self._fd < 0:
            raise ConfigError(f"{self.path}: buffer is closed")
        return os.fstat(self._fd).st_size

    def resize(self, size: int) -> None:
        _check_size(size, minimum=self.size)  # never shrink: another mapper would SIGBUS
        os.ftruncate(self._fd, size)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Read with pread, not through a mapping: a mapping new to this process (the
        agent opens the file for each export) faults on every page it reads, which costs
        more than the copy itself (~0.6 s against ~0.16 s a GiB, bench/checkpoint_hold.py)."""
        _check_span(offset, len(out), self.size, str(self.path))
        done = 0
        while done < len(out):  # one read returns at most ~2 GiB on Linux
            got = os.preadv(self._fd, [out[done:]], offset + done)
            if got == 0:
                raise SnapshotCorrupt(f"{self.path}: ended at byte {offset + done} mid-read")
            done += got

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive; the mapping is released when it goes
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the file (the agent does this when the job ends)."""
        self.path.unlink(missing_ok=True)


def _check_span(offset: int, length: int, size: int, what: str) -> None:
    if offset < 0 or offset + length > size:
        raise SnapshotCorrupt(f"{what}: bytes {offset}..{offset + length} are past its {size} B")


def _check_size(size: int, *, minimum: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < minimum:
        raise ConfigError(f"size={size!r}: must be an int >= {minimum}")
