"""Where an epoch resumes: the rollback decision, and the views it is made from.

Where it sits: in the middle of entering an epoch (job.py). Once the epoch's communicator
is built, every member publishes a `MemberView` of the state it holds (encoded here as
bounded JSON, never pickle: the bytes come from other processes), all members decode the
same views, and each computes the same `resume_plan` from them. The job then moves state
from the plan's source to its needy ranks and restores.

The rule. Members of the last epoch are at most one step apart: a step commits on every
member or none, and the double-buffered snapshots hold the step before as well. So the
members holding committed state ("holders": not fresh, at most one step behind the newest)
resume at the oldest step among them, which every holder that is a step ahead still has in
its older slot. A member further behind (back from a hang, or a restarted worker whose
node kept only older snapshots) is stale, and like a fresh joiner it receives the state
over the network. With no holder at all (a cold start) every member takes rank 0's initial
state, so all start from the same bits. An epoch that falls back to the durable checkpoint
(a double fault lost sharded state) first puts that checkpoint in every member's snapshots
(`fall_back`): all hold it, so all resume there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from keepstep.elastic.control import Fallback
from keepstep.elastic.errors import BadMessage, ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.shard.chunks import MAX_CHUNKS
from keepstep.elastic.snapshot_seed import read_seed
from keepstep.elastic.snapshot_store import SnapshotStore

# A view is a few hundred bytes (the numerics fingerprint is most of it); the bound keeps a
# confused or hostile peer from making every member allocate what it announces.
VIEW_MAX_BYTES = 4096
_MAX_NUMERICS = 16  # fields a view's numerics fingerprint may have (numerics.py checks them)
_MAX_HELD = 16  # snapshot slots a view may list (a node keeps two per worker)
_MAX_STEP = 2**62


@dataclass(frozen=True)
class MemberView:
    """What one member holds when an epoch begins.

    ``fresh``: it started without state of its own (a new joiner, or every member at a cold
    start); ``done``: the steps committed in the state it trains with; ``held``: the steps
    of its valid snapshots, newest first; ``numerics``: its numerics fingerprint as
    ``NumericsFingerprint.as_dict()`` (numerics.py checks it; None: not told); ``chunks``:
    the chunk count its last sharded epoch cut the optimizer state into (shard_epoch.py
    agrees the next one from these; None: it entered none).
    """

    fresh: bool
    done: int
    held: tuple[int, ...]
    numerics: Mapping[str, str | int] | None = None
    chunks: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fresh, bool):
            raise ConfigError(f"fresh={self.fresh!r} must be a bool")
        if not _is_step(self.done):
            raise ConfigError(f"done={self.done!r} must be an int in [0, 2**62]")
        if not isinstance(self.held, tuple) or len(self.held) > _MAX_HELD:
            raise ConfigError(f"held={self.held!r} must be a tuple of at most {_MAX_HELD} steps")
        if not all(_is_step(s) for s in self.held):
            raise ConfigError(f"held={self.held!r} must hold ints in [0, 2**62]")
        n = self.numerics
        if n is not None and not (
            isinstance(n, Mapping)
            and len(n) <= _MAX_NUMERICS
            and all(isinstance(k, str) and isinstance(v, str | int) for k, v in n.items())
        ):
            raise ConfigError(
                f"numerics={n!r} must be a mapping of at most {_MAX_NUMERICS} names to strs or ints"
            )
        c = self.chunks
        if c is not None and not (type(c) is int and 1 <= c <= MAX_CHUNKS):
            raise ConfigError(f"chunks={c!r} must be an int in [1, {MAX_CHUNKS}] (or None)")

    def encode(self) -> bytes:
        """The view as it travels: compact JSON, at most ``VIEW_MAX_BYTES``."""
        data: dict[str, object] = {"fresh": self.fresh, "done": self.done, "held": list(self.held)}
        if self.numerics is not None:
            data["numerics"] = dict(self.numerics)
        if self.chunks is not None:
            data["chunks"] = self.chunks
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, rank: int) -> MemberView:
        """Rank ``rank``'s view from its bytes; ``BadMessage`` naming the rank and the flaw
        unless they are a JSON object with exactly the fields of a valid view."""
        try:
            obj = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError) as error:
            raise BadMessage(f"rank {rank}'s view is not JSON: {error}") from None
        fields = {"fresh", "done", "held"}
        if not isinstance(obj, dict) or not fields <= set(obj) <= fields | {"numerics", "chunks"}:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise BadMessage(
                f"rank {rank}'s view must have fresh, done, held (and numerics, chunks), got {got}"
            )
        held = obj["held"]
        if not isinstance(held, list):
            raise BadMessage(f"rank {rank}'s view: held={held!r} must be a list of steps")
        try:
            return cls(
                obj["fresh"], obj["done"], tuple(held), obj.get("numerics"), obj.get("chunks")
            )
        except ConfigError as error:
            raise BadMessage(f"rank {rank}'s view: {error}") from None


@dataclass(frozen=True)
class ResumePlan:
    """Every member resumes at ``resume_step``; the ranks in ``needy`` (those without a
    snapshot of it) receive rank ``source``'s. ``reason`` says why, for logs and tests."""

    resume_step: int
    source: int
    needy: tuple[int, ...]
    reason: str


def resume_plan(views: Sequence[MemberView]) -> ResumePlan:
    """The step every member of an epoch resumes at, decided from all members' views
    (``views[r]`` is rank r's). Every member computes it from the same views."""
    if not views:
        raise ConfigError("resume_plan needs the view of at least one member")
    holding = [r for r, v in enumerate(views) if not v.fresh]
    newest = max((views[r].done for r in holding), default=0)
    holders = [r for r in holding if views[r].done >= newest - 1]
    notes: list[str] = []
    if holders:
        resume = min(views[r].done for r in holders)
        sources = [r for r in holders if resume in views[r].held]
        if not sources:
            raise SnapshotMissing(
                f"no member holds a snapshot of step {resume}, the step to resume at"
            )
        source = sources[0]
        head = f"resume at step {resume}"
        if resume < newest:
            head += f", a step behind the newest ({newest})"
        for r, v in enumerate(views):
            if v.fresh:
                notes.append(f"rank {r} joins fresh")
            elif r not in holders:
                notes.append(f"rank {r} is stale at step {v.done}")
            elif resume not in v.held:
                notes.append(f"rank {r} no longer holds step {resume}")
    else:
        resume, source = 0, 0
        head = "cold start at step 0 (no member holds committed state)"
    needy = tuple(
        r for r, v in enumerate(views) if r != source and (r not in holders or resume not in v.held)
    )
    if needy:
        who = f"rank {needy[0]} receives" if len(needy) == 1 else f"ranks {_list(needy)} receive"
        notes.append(f"{who} it from rank {source}")
    else:
        notes.append("no state moves")
    return ResumePlan(resume, source, needy, "; ".join([head, *notes]))


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_STEP


def _list(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def fall_back(snapshots: SnapshotStore, fallback: Fallback, timeout: float = 60.0) -> int:
    """Take the durable checkpoint a fallback epoch resumes from (its agent wrote it to
    ``fallback.path`` as one exported snapshot, checksummed) as this member's state, and
    return its step: the member holds that step, as every member now does, and the epoch's
    views resume there (the steps after it are trained again). The checkpoint is the whole
    state, so it is held in memory (``SnapshotStore.seed``), not in the member's slots,
    which keep their size: its own shard and its replicas."""
    path = Path(fallback.path)
    blob = read_seed(path, f"the checkpoint of step {fallback.step} to fall back to")
    try:
        return snapshots.seed(blob, fallback.step, timeout).step  # verified first
    except SnapshotCorrupt as error:
        raise SnapshotCorrupt(f"{path}: {error}") from None
