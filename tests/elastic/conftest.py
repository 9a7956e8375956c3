"""Fixtures shared by the elastic tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from keepstep.elastic.snapshot_store import FileBuffer, MemoryBuffer, SnapshotBuffer


@pytest.fixture(params=["memory", "file"])
def buffer(request: pytest.FixtureRequest, tmp_path: Path) -> SnapshotBuffer:
    """Each kind of memory a snapshot store writes into: a private array, and a mapped file
    (as the node agent makes under /dev/shm)."""
    if request.param == "memory":
        return MemoryBuffer()
    return FileBuffer.create("snap", 0, directory=tmp_path)
