"""The "weights-changed" event folded from commits (`protocol.weights`).

- A commit that carries new weights yields one change per (epoch, step), with the weights
  in force before (equal ones at an epoch's start, else the last change's) and the counts.
- Reports of the same step by other members of the node, and stale epochs, yield nothing.
- One node writes each change: the one that hosts the step's first member.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keepstep.agent.protocol.events import EventKind, EventLog
from keepstep.agent.protocol.messages import Commit
from keepstep.agent.protocol.weights import WeightsChange, WeightsInForce, writes_change

PLAN = {"n0/0": (0, 1, 2), "n0/1": (3, 4, 5), "n1/0": (6, 7, 8)}


def commit(member: str, step: int, epoch: int = 0, new: dict[str, float] | None = None) -> Commit:
    return Commit(
        member=member, step=step, epoch=epoch, world_size=len(PLAN),
        micro_batches=PLAN[member], samples=(), step_s=0.1, assignment=PLAN,
        new_weights=new or {},
    )  # fmt: skip


SLOW = {"n0/0": 1.0, "n0/1": 1.0, "n1/0": 0.33}
BACK = {"n0/0": 1.0, "n0/1": 1.0, "n1/0": 1.0}


def test_a_change_says_what_was_in_force_before() -> None:
    fold = WeightsInForce()
    assert fold.observe(commit("n0/0", 0)) is None
    first = fold.observe(commit("n0/0", 5, new=SLOW))
    assert first == WeightsChange(0, 5, dict.fromkeys(PLAN, 1.0), SLOW, {m: 3 for m in PLAN})
    assert fold.observe(commit("n0/1", 5, new=SLOW)) is None  # the same change, again
    second = fold.observe(commit("n0/1", 12, new=BACK))
    assert second is not None and second.old == SLOW and second.new == BACK


def test_a_new_epoch_starts_from_equal_weights_and_a_stale_one_is_ignored() -> None:
    fold = WeightsInForce()
    fold.observe(commit("n0/0", 5, epoch=1, new=SLOW))
    assert fold.observe(commit("n0/1", 7, epoch=0, new=BACK)) is None
    redone = fold.observe(commit("n0/0", 5, epoch=2, new=SLOW))  # after a rollback
    assert redone is not None and redone.epoch == 2 and redone.old == dict.fromkeys(PLAN, 1.0)


def test_one_node_writes_each_change() -> None:
    c = commit("n1/0", 5, new=SLOW)
    assert writes_change(c, {"n0/0", "n0/1"}) and not writes_change(c, {"n1/0"})


def test_the_event_is_a_known_kind_with_plain_fields(tmp_path: Path) -> None:
    change = WeightsInForce().observe(commit("n0/0", 5, new=SLOW))
    assert change is not None
    log = EventLog(tmp_path / "events-n0.jsonl")
    log.write(EventKind.WEIGHTS_CHANGED, member="n0/0", **change.fields())
    log.close()
    (event,) = [
        json.loads(line) for line in (tmp_path / "events-n0.jsonl").read_text().splitlines()
    ]
    assert event["kind"] == "weights-changed" == EventKind.WEIGHTS_CHANGED
    assert event["step"] == 5 and event["new"] == SLOW and event["counts"]["n1/0"] == 3


def test_a_change_without_new_weights_is_refused() -> None:
    with pytest.raises(ValueError, match="needs the new weights"):
        WeightsChange(0, 1, {}, {})
