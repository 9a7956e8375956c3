"""Columns of ints, one entry per chunk, that derived layouts share until they differ.

Where it sits: storage for ``assign`` (each chunk's owner and replica nodes, and distances).
A layout derived after a loss changes about a thousand entries out of millions: copying the
columns would cost more than the whole update, so a copy shares every block of 1,024
entries and copies one only before writing it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Protocol

__all__ = ["Blocks", "Column"]

_SHIFT = 10  # 1024 entries per block
_LOW = (1 << _SHIFT) - 1


class Column(Protocol):
    """A read-only column of ints (a list, an array, :class:`Blocks`)."""

    def __getitem__(self, i: int, /) -> int: ...

    def __len__(self) -> int: ...


class Blocks:
    """An int array whose copies share storage until written, one block at a time."""

    __slots__ = ("_blocks", "_code", "_len", "_mine")

    def __init__(self, code: str, values: Iterable[int]) -> None:
        flat = array(code, values)
        self._code, self._len = code, len(flat)
        self._blocks = [flat[i : i + _LOW + 1] for i in range(0, len(flat), _LOW + 1)]
        self._mine = set(range(len(self._blocks)))

    def fork(self) -> Blocks:
        """A copy: both share every block, and each copies a block before writing it."""
        out = Blocks.__new__(Blocks)
        out._code, out._len, out._blocks, out._mine = self._code, self._len, [*self._blocks], set()
        self._mine = set()
        return out

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        return self._blocks[i >> _SHIFT][i & _LOW]

    def __setitem__(self, i: int, value: int) -> None:
        b = i >> _SHIFT
        if b not in self._mine:
            self._blocks[b] = array(self._code, self._blocks[b])
            self._mine.add(b)
        self._blocks[b][i & _LOW] = value

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._blocks)

    def gather(self, indices: Iterable[int]) -> list[int]:
        """``[self[i] for i in indices]``, without a method call per item."""
        blocks = self._blocks
        return [blocks[i >> _SHIFT][i & _LOW] for i in indices]
