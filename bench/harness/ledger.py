"""From step-log records to the final trajectory and the sample ledger (pure functions).

The final trajectory is what the final parameters were trained on: for every step, the
newest commit of it (a step redone after a failure or a restart replaces the earlier
commit) and the work of its contributors in that commit's generation. Each contributed
micro-batch names its samples by (data step, micro-batch id), the keying every system
uses, so the ledger counts each sample slot of the planned `steps x n_micro` grid:

    seen once   trained exactly once              lost         never trained
    duplicated  trained more than once (extra)    beyond       outside the grid (a data
                                                               position past the last step)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepEntry:
    """One step of the final trajectory."""

    step: int
    gen: Any
    t_start: float  # the earliest start of the committing attempt
    t_commit: float  # the earliest commit line of it
    world: int  # members whose work is in the update
    samples: int  # samples in the update (the effective global batch)
    once_samples: int  # of those, samples trained exactly once in the whole trajectory
    loss: float | None  # mean loss over the contributed micro-batches


@dataclass(frozen=True)
class Ledger:
    entries: tuple[StepEntry, ...]  # step order
    missing_steps: tuple[int, ...]  # steps with no commit at all
    expected: int
    seen_once: int
    lost: int
    duplicated: int
    beyond: int

    def as_json(self) -> dict[str, Any]:
        return {
            "expected": self.expected,
            "seen_once": self.seen_once,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "beyond": self.beyond,
            "missing_steps": list(self.missing_steps),
        }


def _contributions(
    group: Sequence[dict[str, Any]], work: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The work records in the update a group of commit lines (one step, one gen) made.

    Every system here reduces all-or-nothing within a generation: if anyone committed,
    the reduction completed, so every member's work of that generation and step is in it
    (also a member killed after the reduction, before its own commit line), except a
    member that did not take part (a TorchFT replica still recovering, whose gradient is
    zeroed): its work line says `participating: false`, or its commit line names
    contributors without it.
    """
    t_last = max(float(c["t"]) for c in group)
    idle = {
        str(c["member"])
        for c in group
        if c.get("contributors") is not None and str(c["member"]) not in c["contributors"]
    }
    latest: dict[str, dict[str, Any]] = {}
    for w in work:  # a member's newest attempt before the commit is what it contributed
        if float(w["t"]) <= t_last:
            latest[str(w["member"])] = w
    return [
        w
        for member, w in latest.items()
        if member not in idle and w.get("participating", True) is not False
    ]


def build_ledger(
    records: Sequence[dict[str, Any]],
    steps: int,
    n_micro: int,
    micro_batch: int,
    end_t: float | None = None,
) -> Ledger:
    """`end_t`: ignore lines after it (processes that outlived the job's end)."""
    live = [r for r in records if end_t is None or float(r["t"]) <= end_t]
    commits: dict[int, list[dict[str, Any]]] = defaultdict(list)
    work: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in live:
        if r["kind"] == "commit":
            commits[int(r["step"])].append(r)
        elif r["kind"] == "work":
            work[(int(r["step"]), str(r["gen"]))].append(r)

    chosen: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for step, lines in commits.items():
        newest = max(lines, key=lambda c: float(c["t"]))
        group = [c for c in lines if str(c["gen"]) == str(newest["gen"])]
        chosen[step] = (group, _contributions(group, work[(step, str(newest["gen"]))]))

    seen: dict[tuple[int, int], int] = defaultdict(int)
    for _, contributed in chosen.values():
        for w in contributed:
            for mb in w["mbs"]:
                seen[(int(w["key_step"]), int(mb))] += 1

    entries = []
    for step in sorted(chosen):
        group, contributed = chosen[step]
        mbs = sum(len(w["mbs"]) for w in contributed)
        once = sum(
            1
            for w in contributed
            for mb in w["mbs"]
            if int(w["key_step"]) < steps and seen[(int(w["key_step"]), int(mb))] == 1
        )
        entries.append(
            StepEntry(
                step=step,
                gen=group[0]["gen"],
                t_start=min(float(c["t0"]) for c in group),
                t_commit=min(float(c["t"]) for c in group),
                world=len(contributed),
                samples=mbs * micro_batch,
                once_samples=once * micro_batch,
                loss=sum(float(w["loss_sum"]) for w in contributed) / mbs if mbs else None,
            )
        )
    grid = [(s, mb) for s in range(steps) for mb in range(n_micro)]
    return Ledger(
        entries=tuple(entries),
        missing_steps=tuple(s for s in range(steps) if s not in chosen),
        expected=len(grid) * micro_batch,
        seen_once=sum(1 for slot in grid if seen.get(slot) == 1) * micro_batch,
        lost=sum(1 for slot in grid if slot not in seen) * micro_batch,
        duplicated=sum(n - 1 for slot, n in seen.items() if n > 1 and slot[0] < steps)
        * micro_batch,
        beyond=sum(n for slot, n in seen.items() if slot[0] >= steps) * micro_batch,
    )
