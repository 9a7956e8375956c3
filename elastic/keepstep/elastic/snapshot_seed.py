"""A snapshot held in the worker's memory, outside its slots: a checkpoint to start from.

Where it sits: beside snapshot_store.py, whose ``SnapshotStore.seed`` keeps one. A job
resumed from a durable checkpoint (api.init, from the file KEEPSTEP_RESUME names), and a
sharded job that falls back to one after a double fault (rollback.fall_back), start from
a checkpoint whose parts the node agent joined: the whole optimizer state, many times
what a member's slots hold (its own shard and the replicas it keeps). Imported into the
slots it would grow them, and the node's /dev/shm that a cluster sizes from the members'
snapshots, to twice the whole state for good. Held here it serves the restore and a peer
that lacks it, until the member's own commits after it fill both slots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.snapshot_format import read_index
from keepstep.elastic.snapshot_layout import HEADER, exported_payload

__all__ = ["SEED_SLOT", "Seed", "read_seed"]

SEED_SLOT = -1  # the slot a SnapshotInfo names for the seed: none, it is in memory


@dataclass(frozen=True)
class Seed:
    """A verified exported snapshot (``SnapshotStore.export``'s form: a slot header, then
    the payload), and its step and checksum."""

    step: int
    blob: bytearray
    checksum: int

    @classmethod
    def of(cls, blob: bytes | bytearray, what: str) -> Seed:
        """``blob`` checked (header, checksum, the payload's index): ``SnapshotCorrupt``
        starting with ``what`` otherwise. A ``bytearray`` is kept as it is, not copied."""
        kept = blob if isinstance(blob, bytearray) else bytearray(blob)
        step, payload, checksum = exported_payload(kept, what)
        read_index(step, payload)  # refuse a payload we could not load later
        return cls(step, kept, checksum)

    @property
    def nbytes(self) -> int:
        return len(self.blob) - HEADER

    def payload(self) -> memoryview:
        """A private copy of the payload: what a restore loads may change under it (an
        optimizer keeps the tensors it was given), and the seed must stay intact."""
        return memoryview(bytearray(memoryview(self.blob)[HEADER:]))


def read_seed(path: Path, what: str) -> bytearray:
    """The bytes of the checkpoint file at ``path``, read into one buffer (the seed keeps
    it, not a copy): ``SnapshotMissing`` naming ``what`` if it cannot be read whole."""
    try:
        with path.open("rb") as file:
            blob = bytearray(os.fstat(file.fileno()).st_size)
            got = file.readinto(blob)
    except OSError as error:
        raise SnapshotMissing(f"{what}: {error}") from error
    if got != len(blob):
        raise SnapshotCorrupt(f"{what}: read {got} of the {len(blob)} bytes of {path}")
    return blob
