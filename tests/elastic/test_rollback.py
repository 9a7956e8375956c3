"""The rollback decision is pure: the same views give the same resume step, source, needy
ranks and reason, on every member. Views travel as bounded, validated JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from keepstep.elastic.control import Fallback
from keepstep.elastic.errors import BadMessage, ConfigError, SnapshotCorrupt, SnapshotMissing
from keepstep.elastic.rollback import (
    VIEW_MAX_BYTES,
    MemberView,
    ResumePlan,
    fall_back,
    resume_plan,
)
from keepstep.elastic.snapshot_store import MemoryBuffer, SnapshotStore


def held(done: int, *steps: int) -> MemberView:
    """A member that committed `done` steps and holds snapshots of `steps`."""
    return MemberView(fresh=False, done=done, held=steps)


FRESH = MemberView(fresh=True, done=0, held=(0,))  # a new process: its own initial state

# (case, views in rank order, (resume step, source, needy), reason)
CASES: list[tuple[str, list[MemberView], tuple[int, int, tuple[int, ...]], str]] = [
    (
        "cold start",
        [FRESH, FRESH, FRESH],
        (0, 0, (1, 2)),
        "cold start at step 0 (no member holds committed state); ranks 1, 2 receive it from rank 0",
    ),
    (
        "cold start alone",
        [FRESH],
        (0, 0, ()),
        "cold start at step 0 (no member holds committed state); no state moves",
    ),
    (
        "all equal",
        [held(10, 10, 9), held(10, 10, 9), held(10, 10, 9)],
        (10, 0, ()),
        "resume at step 10; no state moves",
    ),
    (
        "one member a step behind: the others roll back to their older slot",
        [held(10, 10, 9), held(9, 9, 8), held(10, 10, 9)],
        (9, 0, ()),
        "resume at step 9, a step behind the newest (10); no state moves",
    ),
    (
        "a stale member back from a hang",
        [held(10, 10, 9), held(10, 10, 9), held(4, 4, 3)],
        (10, 0, (2,)),
        "resume at step 10; rank 2 is stale at step 4; rank 2 receives it from rank 0",
    ),
    (
        "a fresh joiner",
        [held(10, 10, 9), held(10, 10, 9), FRESH],
        (10, 0, (2,)),
        "resume at step 10; rank 2 joins fresh; rank 2 receives it from rank 0",
    ),
    (
        "a joiner beside members that committed nothing yet",
        [held(0, 0), FRESH],
        (0, 0, (1,)),
        "resume at step 0; rank 1 joins fresh; rank 1 receives it from rank 0",
    ),
    (
        "a restarted worker holding only older snapshots",
        [held(12, 12, 11), held(7, 7, 6), held(12, 12, 11)],
        (12, 0, (1,)),
        "resume at step 12; rank 1 is stale at step 7; rank 1 receives it from rank 0",
    ),
    (
        "a restarted worker whose node kept the step before: nothing moves",
        [held(9, 9, 8), held(10, 10, 9)],
        (9, 0, ()),
        "resume at step 9, a step behind the newest (10); no state moves",
    ),
    (
        "the source is the first member holding the resume step",
        [held(10, 10), held(9, 9, 8), held(10, 10, 9)],
        (9, 1, (0,)),
        "resume at step 9, a step behind the newest (10); rank 0 no longer holds step 9;"
        " rank 0 receives it from rank 1",
    ),
    (
        "a joiner and a stale member while one is a step behind",
        [FRESH, held(10, 10, 9), held(11, 11, 10), held(3, 3, 2)],
        (10, 1, (0, 3)),
        "resume at step 10, a step behind the newest (11); rank 0 joins fresh;"
        " rank 3 is stale at step 3; ranks 0, 3 receive it from rank 1",
    ),
]


@pytest.mark.parametrize(("case", "views", "expected", "reason"), CASES, ids=[c[0] for c in CASES])
def test_resume_plan(
    case: str,
    views: list[MemberView],
    expected: tuple[int, int, tuple[int, ...]],
    reason: str,
) -> None:
    plan = resume_plan(views)
    assert (plan.resume_step, plan.source, plan.needy) == expected, case
    assert plan.reason == reason


def test_no_member_holding_the_resume_step_is_refused_with_the_step() -> None:
    with pytest.raises(SnapshotMissing, match="no member holds a snapshot of step 10"):
        resume_plan([held(10, 9), held(11, 11)])
    with pytest.raises(ConfigError, match="at least one member"):
        resume_plan([])


@st.composite
def epochs(draw: st.DrawFn) -> list[MemberView]:
    """Views as entering an epoch can produce them: members of the last epoch at most a
    step apart with double-buffered snapshots, plus fresh joiners and stale members."""
    newest = draw(st.integers(0, 50))
    kinds = draw(st.lists(st.sampled_from(["ahead", "behind", "fresh", "stale"]), min_size=1))
    views = []
    for kind in kinds:
        if kind == "fresh":
            views.append(FRESH)
        elif kind == "stale" and newest >= 2:
            done = draw(st.integers(0, newest - 2))
            views.append(held(done, *range(done, max(done - 2, -1), -1)))
        else:
            done = max(newest - (kind == "behind"), 0)
            views.append(held(done, *range(done, max(done - 2, -1), -1)))
    return views


@given(epochs())
def test_every_plan_leaves_each_member_with_the_resume_step(views: list[MemberView]) -> None:
    plan = resume_plan(views)
    assert isinstance(plan, ResumePlan) and plan.reason
    assert plan.source not in plan.needy
    assert plan.resume_step in views[plan.source].held
    for rank, view in enumerate(views):
        if rank != plan.source:
            # Who holds the step in state of its own keeps it; everyone else receives it.
            keeps_own = not view.fresh and plan.resume_step in view.held
            assert (rank in plan.needy) == (not keeps_own)
    # Nobody throws away more than the one step a member may be behind.
    newest = max((v.done for v in views if not v.fresh), default=0)
    assert plan.resume_step >= newest - 1
    assert plan == resume_plan(list(views))  # the same views, the same plan (and reason)


def test_a_view_travels_as_compact_bounded_json() -> None:
    view = held(2**62, *range(2**62, 2**62 - 16, -1))
    data = view.encode()
    assert len(data) <= VIEW_MAX_BYTES
    assert MemberView.decode(data, 0) == view
    assert json.loads(FRESH.encode()) == {"fresh": True, "done": 0, "held": [0]}
    # With the numerics fingerprint numerics.py reads (CPU fields), still within the bound.
    fingerprint: dict[str, str | int] = {
        "device_kind": "cuda",
        "device_name": "NVIDIA H200 " + "x" * 200,
        "capability": "9.0",
        "sm_count": 132,
        "driver": "13.0",
        "cuda": "12.9",
        "cublas": "12.9.1.4",
        "cudnn": "91002",
        "torch": "2.15.0+cu129",
    }
    told = MemberView(False, 2**62, view.held, fingerprint, chunks=1 << 23)
    assert len(told.encode()) <= VIEW_MAX_BYTES
    assert MemberView.decode(told.encode(), 0) == told
    assert MemberView.decode(told.encode(), 0).chunks == 1 << 23  # a sharded epoch's count


BAD_VIEWS: list[tuple[bytes, str]] = [
    (b"\xff\xfe", "rank 3's view is not JSON"),
    (b"{not json", "rank 3's view is not JSON"),
    (b"[]", "rank 3's view must have fresh, done, held (and numerics, chunks), got list"),
    (
        b'{"fresh":false,"done":1}',
        "rank 3's view must have fresh, done, held (and numerics, chunks), got ['done', 'fresh']",
    ),
    (
        b'{"fresh":false,"done":1,"held":[1],"extra":0}',
        "(and numerics, chunks), got ['done', 'extra', 'fresh', 'held']",
    ),
    (b'{"fresh":0,"done":1,"held":[1]}', "rank 3's view: fresh=0 must be a bool"),
    (b'{"fresh":false,"done":-1,"held":[]}', "rank 3's view: done=-1 must be an int in [0, 2**62]"),
    (b'{"fresh":false,"done":true,"held":[]}', "rank 3's view: done=True must be an int"),
    (b'{"fresh":false,"done":1.0,"held":[]}', "rank 3's view: done=1.0 must be an int"),
    (b'{"fresh":false,"done":NaN,"held":[]}', "rank 3's view: done=nan must be an int"),
    (b'{"fresh":false,"done":4611686018427387905,"held":[]}', "done=4611686018427387905 must"),
    (b'{"fresh":false,"done":1,"held":"1"}', "rank 3's view: held='1' must be a list of steps"),
    (b'{"fresh":false,"done":1,"held":[],"numerics":[1]}', "rank 3's view: numerics=[1] must"),
    (b'{"fresh":false,"done":1,"held":[],"numerics":{"a":1.5}}', "numerics={'a': 1.5} must"),
    (b'{"fresh":false,"done":1,"held":[1,"0"]}', "rank 3's view: held=(1, '0') must hold ints"),
    (b'{"fresh":false,"done":1,"held":[],"chunks":0}', "rank 3's view: chunks=0 must be an int"),
    (b'{"fresh":false,"done":1,"held":[],"chunks":true}', "chunks=True must be an int in [1, "),
    (b'{"fresh":false,"done":1,"held":[],"chunks":4.0}', "chunks=4.0 must be an int in [1, "),
    (b'{"fresh":false,"done":1,"held":[],"chunks":8388609}', "chunks=8388609 must be an int"),
    (
        b'{"fresh":false,"done":1,"held":[' + b",".join([b"1"] * 17) + b"]}",
        "must be a tuple of at most 16 steps",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD_VIEWS)
def test_a_bad_view_is_refused_naming_the_rank_and_the_flaw(data: bytes, message: str) -> None:
    with pytest.raises(BadMessage, match=re.escape(message)):
        MemberView.decode(data, 3)


def test_a_view_made_here_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=re.escape("done=-2 must be an int in [0, 2**62]")):
        MemberView(fresh=False, done=-2, held=())
    with pytest.raises(ConfigError, match=r"held=.* must be a tuple"):
        MemberView(fresh=False, done=1, held=[1])  # type: ignore[arg-type]


# -- falling back to the durable checkpoint ---------------------------------------------------


def _store_with(*steps: int) -> SnapshotStore:
    store = SnapshotStore(MemoryBuffer(), background=False)
    for step in steps:
        store.commit(step, {"w": torch.full((3,), float(step))}, b"meta")
    return store


def test_fall_back_holds_the_checkpoint_in_memory_and_the_views_resume_there(
    tmp_path: Path,
) -> None:
    checkpoint = tmp_path / "ckpt"
    whole = torch.arange(4096, dtype=torch.float32)  # the whole state: far past a slot
    blob = SnapshotStore(MemoryBuffer(), background=False)
    blob.commit(8, {"w": whole}, b"meta")
    checkpoint.write_bytes(blob.export(8))
    buffer = MemoryBuffer()
    store = SnapshotStore(buffer, background=False)
    for step in (10, 11):  # this member's own timeline, past the checkpoint
        store.commit(step, {"w": torch.full((3,), float(step))}, b"meta")
    size = buffer.size
    assert fall_back(store, Fallback(8, str(checkpoint))) == 8
    # The abandoned steps are gone, here and for a worker restarted over the same buffer;
    # the checkpoint is not in the slots, which kept their size.
    assert [i.step for i in store.infos()] == [8]
    assert SnapshotStore(buffer, background=False).infos() == []
    assert buffer.size == size
    loaded = store.load(8).tensors["w"]
    assert torch.equal(loaded, whole)
    loaded.add_(1.0)  # what a restore was given may change: the checkpoint does not
    assert torch.equal(store.load().tensors["w"], whole)
    assert store.export(8) == checkpoint.read_bytes()  # for a peer that lacks it
    # Every member did the same: all resume at the checkpoint's step, nothing moves.
    views = [held(8, 8), held(8, 8), MemberView(False, 8, (8,))]
    plan = resume_plan(views)
    assert (plan.resume_step, plan.needy) == (8, ())
    store.commit(9, {"w": torch.full((3,), 9.0)}, b"meta")
    assert [i.step for i in store.infos()] == [9, 8]  # one step behind is still served
    store.commit(10, {"w": torch.full((3,), 10.0)}, b"meta")
    assert [i.step for i in store.infos()] == [10, 9]  # two commits after it: dropped
    with pytest.raises(SnapshotMissing):
        store.load(8)
    assert buffer.size == size


def test_fall_back_refuses_a_missing_damaged_or_other_checkpoint(tmp_path: Path) -> None:
    store = _store_with(10)
    with pytest.raises(SnapshotMissing, match="the checkpoint of step 8 to fall back to"):
        fall_back(store, Fallback(8, str(tmp_path / "absent")))
    blob = bytearray(_store_with(8).export(8))
    blob[-1] ^= 0xFF
    damaged = tmp_path / "damaged"
    damaged.write_bytes(bytes(blob))
    with pytest.raises(SnapshotCorrupt, match="damaged: checkpoint: payload checksum"):
        fall_back(store, Fallback(8, str(damaged)))
    other = tmp_path / "other"
    other.write_bytes(_store_with(4).export(4))
    with pytest.raises(SnapshotCorrupt, match="other: checkpoint: holds step 4, not 8"):
        fall_back(store, Fallback(8, str(other)))
    assert [i.step for i in store.infos()] == [10]  # refused before the slots were touched


@pytest.mark.parametrize(
    ("step", "path", "says"),
    [(-1, "/x", "step=-1"), (True, "/x", "step=True"), (3, "", "needs the path")],
)
def test_a_fallback_needs_a_step_and_a_path(step: int, path: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Fallback(step, path)
