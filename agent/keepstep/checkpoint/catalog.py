"""Which steps a durable checkpoint location holds, and what state each one is in.

Where it sits: under `keepstep checkpoint` (cli.py). The node agents' writer
(keepstep.agent.durable.writer) lays checkpoints out under a URL; the reader a resumed job
uses (durable.reader) returns only the newest intact one and skips the rest. A person
looking at a location wants every step shown, with the reason a step is not usable, so this
module reads the same files through the same ``Store`` with the reader's rules (a step is
published once latest.json names it or a later one; a blob must match the sha256 of its
record) but reports instead of skipping. No torch here: `ls --quick` reads records only.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from dataclasses import dataclass, field

from keepstep.agent.durable.parts import read_parts
from keepstep.agent.durable.storage import (
    LATEST,
    CheckpointInfo,
    Location,
    Store,
    blob_name,
    bounded,
    info_name,
    step_files,
)
from keepstep.elastic.errors import SnapshotCorrupt, SnapshotMissing
from keepstep.errors import ConfigError, KeepstepError


class Status(enum.Enum):
    """A step's state. PUBLISHED becomes INTACT or DAMAGED once its blob is read."""

    PUBLISHED = "published"  # latest.json covers it, record and blob present; blob not read
    INTACT = "intact"  # the blob matches its record and decodes
    DAMAGED = "damaged"  # a record, blob or payload that does not check out
    MISSING = "missing"  # published, but its blob or record is gone
    INCOMPLETE = "incomplete"  # not published: a writer stopped part-way, or another run's


class Unusable(KeepstepError):
    """The step asked for exists but cannot be exported (damaged, missing, incomplete)."""


@dataclass(frozen=True)
class Step:
    step: int
    status: Status
    info: CheckpointInfo | None  # None when the record is missing or unreadable
    reason: str = ""  # why the status is not PUBLISHED / INTACT
    params_sha256: str | None = None  # once the blob was decoded
    state_sha256: dict[str, str] = field(default_factory=dict)  # per tracked object

    def to_json(self) -> dict[str, object]:
        info = self.info
        return {
            "step": self.step,
            "status": self.status.value,
            "reason": self.reason or None,
            "url": info.url if info else None,
            "nbytes": info.nbytes if info else None,
            "sha256": info.sha256 if info else None,
            "written_at": info.written_at if info else None,
            "params_sha256": self.params_sha256,
            "state_sha256": self.state_sha256,
        }


@dataclass(frozen=True)
class Catalog:
    url: str
    latest: int | None  # the step latest.json names; None when it is absent or damaged
    note: str  # what latest.json said, for a person
    steps: tuple[Step, ...]  # ascending

    def newest(self) -> Step | None:
        """What a resumed job would start from: the newest intact step, or before blobs
        are read, the newest published one."""
        usable = (Status.INTACT, Status.PUBLISHED)
        return next((s for s in reversed(self.steps) if s.status in usable), None)

    def pick(self, step: int | None) -> Step:
        """The step to export: ``step``, or the newest published one. ConfigError when
        there is no such step (naming the ones there are), Unusable when it is not whole."""
        there = ", ".join(str(s.step) for s in self.steps) or "none"
        if step is None:
            found = self.newest()
            if found is None:
                raise Unusable(f"{self.url}: no complete checkpoint ({self.note}; steps: {there})")
            return found
        found = next((s for s in self.steps if s.step == step), None)
        if found is None:
            raise ConfigError(
                f"--step {step}: no checkpoint of step {step} at {self.url}; steps there: {there}"
            )
        if found.status not in (Status.PUBLISHED, Status.INTACT):
            raise Unusable(f"{self.url} step {step} is {found.status.value}: {found.reason}")
        return found


def scan(loc: Location, timeout: float) -> Catalog:
    """Every step with files under ``loc``; ConfigError when there is none at all."""
    catalog = bounded(lambda: _scan(Store(loc)), timeout, f"listing checkpoints at {loc.url}")
    if not catalog.steps:
        raise ConfigError(f"{loc.url}: no checkpoint there")
    return catalog


def read_blob(loc: Location, step: Step, timeout: float) -> bytes:
    """The blob of a published step, checked against its record: SnapshotMissing when it is
    gone, SnapshotCorrupt when its size or sha256 differ. A sharded job's step is its
    members' parts, each checked, as one bundle (``contents.decode`` joins them)."""
    info = step.info
    if info is None or step.status not in (Status.PUBLISHED, Status.INTACT):
        raise Unusable(f"{loc.url} step {step.step} is {step.status.value}: {step.reason}")

    def get() -> bytes:
        try:
            return Store(loc).get(blob_name(step.step))
        except FileNotFoundError:
            raise SnapshotMissing(f"{info.url}: gone since it was listed") from None

    blob = bounded(get, timeout, f"reading {info.url}")
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) != info.nbytes or digest != info.sha256:
        raise SnapshotCorrupt(
            f"{info.url}: {len(blob)} B with sha256 {digest}, "
            f"its record says {info.nbytes} B with sha256 {info.sha256}"
        )
    if not info.parts:
        return blob

    def parts() -> bytes:  # a sharded job's: the blob is the manifest of its parts
        try:
            return read_parts(Store(loc), info, blob)
        except FileNotFoundError as e:
            raise SnapshotMissing(f"{info.url}: part {e} gone") from None

    return bounded(parts, timeout, f"reading the {info.parts} parts of {info.url}")


def intact(step: Step, params_sha256: str, state_sha256: dict[str, str]) -> Step:
    """``step`` once its blob was read and decoded, with its hashes."""
    return dataclasses.replace(
        step, status=Status.INTACT, params_sha256=params_sha256, state_sha256=state_sha256
    )


def unreadable(step: Step, error: SnapshotCorrupt | SnapshotMissing) -> Step:
    """``step`` once reading or decoding its blob failed, with the reason."""
    status = Status.MISSING if isinstance(error, SnapshotMissing) else Status.DAMAGED
    return dataclasses.replace(step, status=status, reason=str(error))


def _scan(store: Store) -> Catalog:
    names = store.names()
    by_step = step_files(names)
    latest: CheckpointInfo | None = None
    try:
        latest = CheckpointInfo.from_json(store.get(LATEST), f"{store.url}/{LATEST}")
        bound, note = latest.step, f"{LATEST} names step {latest.step}"
    except FileNotFoundError:
        bound, note = -1, f"no {LATEST}: no checkpoint was completed"
    except SnapshotCorrupt as e:
        # As the reader does: every blob is checked against its own sha256.
        bound, note = max(by_step, default=-1), f"{e}; every step present is considered"
    if latest is not None:
        by_step.setdefault(latest.step, set())
    steps = [_step(store, s, by_step[s], s <= bound, latest) for s in sorted(by_step)]
    return Catalog(store.url, None if latest is None else latest.step, note, tuple(steps))


def _step(
    store: Store, step: int, files: set[str], published: bool, latest: CheckpointInfo | None
) -> Step:
    info: CheckpointInfo | None = None
    problem = ""
    url = store.url_of(blob_name(step))
    if info_name(step) in files:
        try:
            record = CheckpointInfo.from_json(store.get(info_name(step)), f"{url} record")
            if record.step == step:
                info = record
            else:
                problem = f"{url} record says step {record.step}"
        except (FileNotFoundError, SnapshotCorrupt) as e:
            problem = str(e)
    else:
        problem = f"no record {info_name(step)}"
    if info is None and latest is not None and latest.step == step:
        info, problem = latest, ""  # its record was lost, but latest.json holds a copy
    if info is not None:
        info = dataclasses.replace(info, url=url)  # where it is now (it may have been copied)
    if not published:
        why = "not published: no later latest.json names it"
        return Step(step, Status.INCOMPLETE, info, why if not problem else f"{why}; {problem}")
    if blob_name(step) not in files:
        return Step(step, Status.MISSING, info, f"no blob {blob_name(step)}")
    if info is None:
        status = Status.MISSING if problem.startswith("no record") else Status.DAMAGED
        return Step(step, status, None, problem)
    return Step(step, Status.PUBLISHED, info)
