"""A sharded job's durable checkpoint: one part per member, and the manifest that joins them.

Where it sits: under the writer (writer.py) and the reader (reader.py), over the ``Store``
(storage.py). A sharded member's snapshot holds the parameters and its own pieces of the
optimizer state, so a checkpoint of step S is every member's snapshot of S. Each node's
agent writes its members' parts at once, each with its record; the epoch's first member
also publishes: it waits until every part's record is in storage, then writes the
manifest as the step's blob, the step's record (``parts`` = the member count) and
latest.json, in that order. So a reader sees a sharded checkpoint only once all its parts
are written, exactly as it sees a whole one only once its blob is; a part that never
comes (its member died) leaves the step unpublished and the one before it in force.

The manifest is JSON: the step, the epoch, and per part its file name, bytes and sha256.
Names in it are relative to the checkpoint's URL, so a copied bucket still reads.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from keepstep.agent.durable.storage import (
    LATEST,
    CheckpointInfo,
    Store,
    blob_name,
    info_name,
    part_name,
)
from keepstep.elastic.errors import SnapshotCorrupt
from keepstep.errors import KeepstepError

__all__ = [
    "Part",
    "PartsMissing",
    "bundle",
    "publish_parts",
    "read_parts",
    "unbundle",
    "write_part",
]

_MANIFEST_FORMAT = 1
_BUNDLE = b"KSPARTS1"  # starts a bundle; a snapshot slot starts with its own magic
_POLL_S = (0.05, 1.0)  # first and longest wait between listings while parts are missing


class PartsMissing(KeepstepError):
    """Not every member's part of a step reached storage in time: the step is not published."""


@dataclass(frozen=True)
class Part:
    """Which part a member writes: its index among the epoch's ``count`` members, and
    whether it publishes the step (the epoch's first member does)."""

    epoch: int
    index: int
    count: int
    publish: bool = False

    def __post_init__(self) -> None:
        for name, value, low in (("epoch", self.epoch, 0), ("count", self.count, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: must be an int >= {low}")
        if isinstance(self.index, bool) or not 0 <= self.index < self.count:
            raise ValueError(f"index={self.index!r}: must be an int in 0..{self.count - 1}")


def write_part(store: Store, step: int, part: Part, blob: bytes | bytearray) -> CheckpointInfo:
    """Put one member's part and then its record; the record says the part is whole."""
    name = part_name(step, part.epoch, part.index, part.count)
    store.put(name, blob)
    info = CheckpointInfo(
        store.url_of(name), step, len(blob), hashlib.sha256(blob).hexdigest(), time.time()
    )
    store.put(part_name(step, part.epoch, part.index, part.count, "json"), info.to_json())
    return info


def publish_parts(
    store: Store,
    step: int,
    part: Part,
    timeout: float,
    superseded: Callable[[], int | None] = lambda: None,
) -> CheckpointInfo:
    """Once every part of ``step`` has its record (waiting up to ``timeout`` s): the
    manifest, the step's record and latest.json. ``PartsMissing`` names the parts still
    missing at the deadline, or as soon as ``superseded()`` names a newer step this
    writer has to write (a member that could not export its part of this step, whose
    snapshot moved on, must not hold back every step after it)."""
    records = [part_name(step, part.epoch, k, part.count, "json") for k in range(part.count)]
    deadline = time.monotonic() + timeout
    pause = _POLL_S[0]
    while True:
        missing = sorted(set(records) - set(store.names()))
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise PartsMissing(
                f"step {step}: {len(missing)} of {part.count} parts not written after "
                f"{timeout} s (first: {missing[0]}); the step is not published"
            )
        newer = superseded()
        if newer is not None:
            raise PartsMissing(
                f"step {step}: {len(missing)} of {part.count} parts not written (first: "
                f"{missing[0]}) when step {newer} came; the step is not published"
            )
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, _POLL_S[1])
    entries = []
    for k, record in enumerate(records):
        info = CheckpointInfo.from_json(store.get(record), store.url_of(record))
        name = part_name(step, part.epoch, k, part.count)
        entries.append({"name": name, "nbytes": info.nbytes, "sha256": info.sha256})
    manifest = json.dumps(
        {"format": _MANIFEST_FORMAT, "step": step, "epoch": part.epoch, "parts": entries},
        indent=1,
    ).encode()
    store.put(blob_name(step), manifest)
    info = CheckpointInfo(
        store.url_of(blob_name(step)),
        step,
        len(manifest),
        hashlib.sha256(manifest).hexdigest(),
        time.time(),
        parts=part.count,
    )
    store.put(info_name(step), info.to_json())
    store.put(LATEST, info.to_json())
    return info


def read_parts(store: Store, info: CheckpointInfo, manifest: bytes) -> bytes:
    """A sharded checkpoint's parts, each verified against the sha256 the manifest gives,
    as one ``bundle``. ``SnapshotCorrupt`` for a manifest or part that does not check
    out, FileNotFoundError for a part that is gone."""
    where = f"{info.url} (manifest of step {info.step})"
    try:
        record = json.loads(manifest)
        if record["format"] != _MANIFEST_FORMAT or record["step"] != info.step:
            raise ValueError(f"format {record['format']!r}, step {record['step']!r}")
        entries = [(str(e["name"]), int(e["nbytes"]), str(e["sha256"])) for e in record["parts"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotCorrupt(f"{where}: not a manifest ({e})") from None
    if len(entries) != info.parts:
        raise SnapshotCorrupt(f"{where}: lists {len(entries)} parts, its record {info.parts}")
    blobs = []
    for name, nbytes, sha256 in entries:
        if "/" in name or not name.startswith(f"step-{info.step:08d}."):
            raise SnapshotCorrupt(f"{where}: part {name!r} is not a file of this step")
        blob = store.get(name)
        digest = hashlib.sha256(blob).hexdigest()
        if len(blob) != nbytes or digest != sha256:
            raise SnapshotCorrupt(
                f"{store.url_of(name)}: {len(blob)} B with sha256 {digest}, "
                f"manifest says {nbytes} B with sha256 {sha256}"
            )
        blobs.append(blob)
    return bundle(blobs)


def bundle(blobs: list[bytes]) -> bytes:
    """The parts of a sharded checkpoint as one blob, for whoever seeds snapshots from it
    (``unbundle``, then ``keepstep.elastic.sharded_checkpoint.join_parts``). Joining
    needs torch, which the launchers and tools that read checkpoints do not load."""
    lengths = b"".join(len(b).to_bytes(8, "little") for b in blobs)
    return _BUNDLE + len(blobs).to_bytes(8, "little") + lengths + b"".join(blobs)


def unbundle(blob: bytes) -> list[bytes] | None:
    """The parts of a ``bundle``; None for any other blob (a whole snapshot's slot).
    ``SnapshotCorrupt`` when the lengths do not add up."""
    if not blob.startswith(_BUNDLE):
        return None
    at = len(_BUNDLE) + 8
    count = int.from_bytes(blob[len(_BUNDLE) : at], "little")
    if count < 1 or at + 8 * count > len(blob):
        raise SnapshotCorrupt(f"a bundle of {len(blob)} B cannot hold {count} parts")
    lengths = [int.from_bytes(blob[at + 8 * i : at + 8 * i + 8], "little") for i in range(count)]
    at += 8 * count
    if at + sum(lengths) != len(blob):
        raise SnapshotCorrupt(f"a bundle of {len(blob)} B: its {count} parts' lengths differ")
    out = []
    for n in lengths:
        out.append(blob[at : at + n])
        at += n
    return out
