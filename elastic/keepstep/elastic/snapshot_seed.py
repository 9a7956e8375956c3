"""A snapshot held in the worker's memory, outside its slots: a fallback's checkpoint.

Where it sits: beside snapshot_store.py, whose ``SnapshotStore.seed`` keeps one. When a
double fault took a sharded job's state, every member falls back to the newest durable
checkpoint (rollback.fall_back), its parts joined by the node agent: the whole optimizer
state, many times what a member's slots hold (its own shard and the replicas it keeps).
Imported into the slots it would grow them, and the node's /dev/shm that a cluster sizes
from the members' snapshots, to twice the whole state for good. Held here it serves the
restore and a peer that lacks it, until the member's own commits after it fill both slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from keepstep.elastic.snapshot_format import read_index
from keepstep.elastic.snapshot_layout import HEADER, exported_payload

__all__ = ["SEED_SLOT", "Seed"]

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
