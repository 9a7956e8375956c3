"""The record every job writes, whatever system runs it: work done and steps committed.

Each training process appends JSON lines to a file of its own in the run's log folder
(`<member>-<pid>.jsonl`; no two writers share a file). Two kinds of line carry the ledger:

    work    {gen, step, key_step, member, mbs, loss_sum, participating, t0, t}
            this member computed micro-batches `mbs` of data step `key_step` for training
            step `step`, in generation `gen` (keepstep epoch, torchrun world, TorchFT
            quorum); written before the step's reduction, so a kill during or after the
            reduction cannot leave committed work unrecorded; `participating` is false for
            work whose gradient is not used (a TorchFT replica still recovering);
    commit  {gen, step, member, contributors, world, t0, t}
            step `step` was applied in `gen`, as this member saw it; `contributors`, when
            given, lists the members this line vouches for (a member that names others but
            not itself did not take part); null: the reduction is all-or-nothing (DDP).

bench/harness/ledger.py turns these into the final trajectory. Times are wall clock
(`time.time()`), since processes of one machine are put on one timeline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class StepLog:
    """Append-only, line-buffered: a line is on disk before the next collective starts."""

    def __init__(self, folder: Path, member: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.member = member
        safe = member.replace("/", "_")
        self._file = open(folder / f"{safe}-{os.getpid()}.jsonl", "a", buffering=1)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, "t": time.time(), "member": self.member, "pid": os.getpid()}
        self._file.write(json.dumps({**record, **fields}) + "\n")

    def work(
        self,
        gen: int | float | str,
        step: int,
        key_step: int,
        mbs: Sequence[int],
        loss_sum: float,
        t0: float,
        participating: bool = True,
    ) -> None:
        self.event(
            "work",
            gen=gen,
            step=step,
            key_step=key_step,
            mbs=list(mbs),
            loss_sum=loss_sum,
            participating=participating,
            t0=t0,
        )

    def commit(
        self,
        gen: int | float | str,
        step: int,
        contributors: Sequence[str] | None,
        world: int,
        t0: float,
    ) -> None:
        who = None if contributors is None else list(contributors)
        self.event("commit", gen=gen, step=step, contributors=who, world=world, t0=t0)

    def close(self) -> None:
        self._file.close()


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every line of every file in `folder`, in time order; a torn last line is skipped."""
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the process was killed while writing this line
    out.sort(key=lambda r: float(r["t"]))
    return out


def steps_done(folder: Path) -> int:
    """The job's progress as fault injection sees it: the newest committed step + 1."""
    return max(
        (int(r["step"]) + 1 for r in read_records(folder) if r["kind"] == "commit"), default=0
    )


def latest_world(folder: Path) -> int | None:
    """The world size in the newest commit line (None before the first)."""
    commits = [r for r in read_records(folder) if r["kind"] == "commit"]
    return int(commits[-1]["world"]) if commits else None
