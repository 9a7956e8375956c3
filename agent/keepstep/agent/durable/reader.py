"""Reading durable checkpoints back: the newest intact one, or the list of published ones.

Where it sits: ``keepstep run --resume URL`` calls ``latest_checkpoint`` (re-exported by
``checkpoint``) and feeds the blob to ``SnapshotStore.import_``. A checkpoint exists for
readers only once latest.json names it or a later step, so files a writer left part-way are
never returned; a damaged or missing newest checkpoint falls back to the one before it, each
blob verified against the sha256 in its record. Storage is reached through ``checkpoint_io``,
every call under a deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keepstep.agent.durable.parts import read_parts
from keepstep.agent.durable.storage import (
    LATEST,
    CheckpointInfo,
    Location,
    Store,
    blob_name,
    bounded,
    check_timeout,
    info_name,
    step_files,
)
from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing

__all__ = ["checkpoint_at", "latest_checkpoint", "list_checkpoints"]

# The logger of the module these functions came from, so logging set up for it still applies.
log = logging.getLogger("keepstep.agent.durable.writer")


def latest_checkpoint(
    url: str, timeout: float, storage_options: Mapping[str, Any] | None = None
) -> tuple[CheckpointInfo, bytes] | None:
    """The newest published checkpoint whose blob matches its sha256, and the blob. For a
    sharded job's checkpoint (``info.parts`` > 0) the blob is its members' parts, each
    verified, as one bundle (parts.py): the agent joins them into one snapshot that seeds
    every member of a job of any size.

    None when latest.json does not exist (no checkpoint was ever completed). A damaged or
    missing newest checkpoint is skipped with a warning; if every published one is damaged or
    missing, SnapshotCorrupt or SnapshotMissing says why.
    """
    loc = Location.parse(url, storage_options)
    check_timeout(timeout)
    return bounded(lambda: _read_latest(Store(loc)), timeout, f"reading checkpoints at {url}")


def checkpoint_at(
    url: str, step: int, timeout: float, storage_options: Mapping[str, Any] | None = None
) -> tuple[CheckpointInfo, bytes]:
    """The published checkpoint of ``step`` and its verified blob (bundled parts for a
    sharded job), for agents that agreed to fall back to that step: the newest may have
    moved on meanwhile. ``SnapshotMissing`` if the step was never published,
    ``SnapshotCorrupt`` if its files do not match their records."""
    loc = Location.parse(url, storage_options)
    check_timeout(timeout)

    def read() -> tuple[CheckpointInfo, bytes]:
        store = Store(loc)
        scan = _scan(store)
        if scan is None or step not in scan.candidates:
            raise SnapshotMissing(f"{store.url}: no published checkpoint of step {step}")
        try:
            return _verified(store, scan, step)
        except FileNotFoundError as e:
            raise SnapshotMissing(f"{store.url}: checkpoint of step {step}: {e} missing") from e

    return bounded(read, timeout, f"reading the checkpoint of step {step} at {url}")


def list_checkpoints(
    url: str, timeout: float, storage_options: Mapping[str, Any] | None = None
) -> list[CheckpointInfo]:
    """Published checkpoints whose record and blob exist, oldest first; blobs are not read
    (``latest_checkpoint`` verifies)."""
    loc = Location.parse(url, storage_options)
    check_timeout(timeout)
    return bounded(lambda: _read_list(Store(loc)), timeout, f"listing checkpoints at {url}")


def _read_latest(store: Store) -> tuple[CheckpointInfo, bytes] | None:
    scan = _scan(store)
    if scan is None:
        return None
    errors: list[str] = []
    missing = False
    for step in sorted(scan.candidates, reverse=True):
        try:
            return _verified(store, scan, step)
        except FileNotFoundError as e:
            log.warning("skipping checkpoint of step %d under %s: %s missing", step, store.url, e)
            missing = True
        except SnapshotCorrupt as e:
            log.warning("skipping damaged checkpoint of step %d: %s", step, e)
            errors.append(str(e))
    if errors:
        raise SnapshotCorrupt(f"no intact checkpoint under {store.url}: " + "; ".join(errors))
    detail = " (files missing)" if missing else ""
    raise SnapshotMissing(f"{store.url}/{LATEST} exists but no checkpoint is left{detail}")


def _verified(store: Store, scan: _Scan, step: int) -> tuple[CheckpointInfo, bytes]:
    """The record and blob of ``step``, the blob checked against the record's sha256 (a
    sharded job's: its parts, each checked, bundled)."""
    info = scan.info(step)
    blob = store.get(blob_name(step))
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) != info.nbytes or digest != info.sha256:
        raise SnapshotCorrupt(
            f"{info.url}: {len(blob)} B with sha256 {digest}, "
            f"record says {info.nbytes} B with sha256 {info.sha256}"
        )
    return info, read_parts(store, info, blob) if info.parts else blob


def _read_list(store: Store) -> list[CheckpointInfo]:
    scan = _scan(store)
    if scan is None:
        return []
    out = []
    for step in sorted(scan.candidates):
        if blob_name(step) not in scan.by_step.get(step, set()):
            continue
        try:
            out.append(scan.info(step))
        except (FileNotFoundError, SnapshotCorrupt) as e:
            log.warning("not listing checkpoint of step %d under %s: %s", step, store.url, e)
    return out


@dataclass(frozen=True)
class _Scan:
    store: Store
    latest: CheckpointInfo | None  # None: latest.json is damaged
    by_step: dict[int, set[str]]
    candidates: list[int]  # steps a reader may return

    def info(self, step: int) -> CheckpointInfo:
        """The record of ``step``, with the url of where it was read from (it may have been
        copied since it was written)."""
        url = self.store.url_of(blob_name(step))
        try:
            info = CheckpointInfo.from_json(self.store.get(info_name(step)), f"{url} record")
        except (FileNotFoundError, SnapshotCorrupt):
            if self.latest is None or self.latest.step != step:
                raise
            info = self.latest  # its record was lost, but latest.json holds a copy
        if info.step != step:
            raise SnapshotCorrupt(f"{url}: record says step {info.step}")
        return dataclasses.replace(info, url=url)


def _scan(store: Store) -> _Scan | None:
    names = store.names()
    by_step = step_files(names)
    try:
        raw = store.get(LATEST)
    except FileNotFoundError:
        if by_step:
            log.warning(
                "%s has files of steps %s but no %s: no checkpoint was completed",
                store.url,
                sorted(by_step),
                LATEST,
            )
        return None
    try:
        latest: CheckpointInfo | None = CheckpointInfo.from_json(raw, f"{store.url}/{LATEST}")
    except SnapshotCorrupt as e:
        # Every blob is checked against its own sha256, so any step that verifies is whole.
        log.warning("%s; considering every checkpoint present", e)
        latest = None
    bound = math.inf if latest is None else latest.step
    candidates = [s for s in by_step if s <= bound]
    if latest is not None and latest.step not in candidates:
        candidates.append(latest.step)  # let the reader say that its files are missing
    return _Scan(store, latest, by_step, candidates)
