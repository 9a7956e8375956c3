"""The recovery fold: one table of event logs (with the faults injected, if any) and the
records it must make of them, and the phases laid end to end."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from keepstep.agent.protocol.events import EventKind, kind_of
from keepstep.agent.protocol.recovery import (
    PHASES,
    Effect,
    InjectedFault,
    RecoveryRecord,
    phases,
    recoveries,
)

Event = dict[str, Any]
MEMBERS = ["n0/0", "n1/0", "n2/0"]


def agreed(t: float, epoch: int, members: list[str], **fields: Any) -> Event:
    return {"t": t, "kind": "epoch-agreed", "epoch": epoch, "members": members, **fields}


def planned(
    t: float, epoch: int, members: list[str], admit: str = "", drain: str = "", **fields: Any
) -> Event:
    """A step-boundary change as the healer writes it now: with `admitted` and `removed`."""
    reason = "; ".join(f"{word} {who}" for word, who in (("admit", admit), ("drain", drain)) if who)
    admitted, removed = [admit] if admit else [], [drain] if drain else []
    fields |= {"admitted": admitted, "removed": removed}
    return agreed(t, epoch, members, planned=True, reason=reason, **fields)


def lost(t: float, epoch: int, members: list[str], removed: list[str], **fields: Any) -> Event:
    """An epoch agreed after a failure, as the healer writes it now: with `removed`."""
    reason = "lost " + ",".join(removed)
    return agreed(t, epoch, members, planned=False, reason=reason, removed=removed, **fields)


def detected(t: float, epoch: int, cause: str, node: str, **fields: Any) -> Event:
    return {"t": t, "kind": "fault-detected", "epoch": epoch, "cause": cause, "node": node,
            "reason": "", **fields}  # fmt: skip


def reconfigured(t: float, epoch: int, member: str, resume: int, rolled: int = 0) -> Event:
    return {"t": t, "kind": "reconfigured", "member": member, "epoch": epoch,
            "communicator_s": 0.05, "restore_s": 0.03, "replan_s": 0.001, "resume_step": resume,
            "rolled_back_steps": rolled, "received_state": False}  # fmt: skip


def commit(t: float, epoch: int, step: int) -> Event:
    return {"t": t, "kind": "commit", "member": "n0/0", "epoch": epoch, "step": step}


def fault(kind: str, t: float, node: str | None) -> InjectedFault:
    effect = {"join-node": Effect.JOIN, "drain-node": Effect.DRAIN}.get(kind, Effect.FAILURE)
    return InjectedFault(kind, t, effect, node)


START = [agreed(0.0, 0, MEMBERS, reason="3 of 3 workers ready"), commit(1.0, 0, 0)]
LOST_N2 = {"planned": False, "reason": "lost n2/0", "removed": ["n2/0"], "admitted": []}


# Each case: the events after epoch 0, the faults injected, and per recovery
# (cause, node, epoch, step, detect_s, agree_s, mttr_s, rolled_back_steps, fault).
CASES: dict[str, tuple[list[Event], list[InjectedFault], list[tuple[Any, ...]]]] = {
    "kill: timed from the fault, phases from the slowest member": (
        [
            detected(5.1, 0, "collective", "n0"),
            agreed(5.3, 1, ["n0/0", "n1/0"], step=4, agree_s=0.2, **LOST_N2),
            reconfigured(5.4, 1, "n0/0", resume=3, rolled=1),
            reconfigured(5.41, 1, "n1/0", resume=3),
            commit(5.6, 1, 3),
            commit(5.7, 1, 4),
        ],
        [fault("kill-node", 5.0, "n2")],
        [("kill-node", "n2", 1, 3, 0.1, 0.2, 0.6, 1, 0)],
    ),
    "hang: found by the lease, no member measured": (
        [
            detected(6.0, 0, "lease-expired", "n1"),
            agreed(6.2, 1, ["n0/0", "n2/0"], step=7, planned=False, reason="lost n1/0"),
            commit(6.5, 1, 7),
        ],
        [fault("hang-node", 5.0, "n1")],
        [("hang-node", "n1", 1, 7, 1.0, 0.2, 1.5, 0, 0)],
    ),
    "drain: announced, not detected; nothing rolled back": (
        [
            {"t": 5.01, "kind": "drain-requested", "node": "n2"},
            planned(5.4, 1, ["n0/0", "n1/0"], drain="n2/0", step=6),
            reconfigured(5.45, 1, "n0/0", resume=6),
            commit(5.5, 1, 6),
        ],
        [fault("drain-node", 5.0, "n2")],
        [("drain-node", "n2", 1, 6, 0.4, 0.0, 0.5, 0, 0)],
    ),
    "join: the admission of its own node, however long it took to start": (
        [
            planned(8.0, 1, [*MEMBERS, "n3/0"], admit="n3/0", step=9),
            commit(8.2, 1, 9),
        ],
        [fault("join-node", 2.0, "n3")],
        [("join-node", "n3", 1, 9, 6.0, 0.0, 6.2, 0, 0)],
    ),
    "a restarted worker rejoins: no fault of its own, the join waits for its node": (
        [
            detected(5.01, 0, "worker-exit", "n1"),
            agreed(5.1, 1, ["n0/0", "n2/0"], step=4, reason="lost n1/0", removed=["n1/0"]),
            commit(5.3, 1, 4),
            planned(7.0, 2, MEMBERS, admit="n1/0", step=6),
            commit(7.1, 2, 6),
            planned(9.0, 3, [*MEMBERS, "n4/0"], admit="n4/0", step=8),
            commit(9.3, 3, 8),
        ],
        [fault("join-node", 6.0, "n4"), fault("kill-worker", 5.0, "n1")],
        [
            ("kill-worker", "n1", 1, 4, 0.01, 0.09, 0.3, 0, 1),
            ("rejoin", "n1", 2, 6, 0.0, 0.0, 0.1, 0, None),
            ("join-node", "n4", 3, 8, 3.0, 0.0, 3.3, 0, 0),
        ],
    ),
    "a fault during a recovery: the first ends with the second's first commit": (
        [
            detected(5.1, 0, "collective", "n0"),
            agreed(5.2, 1, ["n0/0", "n1/0"], step=4, **LOST_N2),
            detected(5.3, 1, "worker-exit", "n1"),
            agreed(5.4, 2, ["n0/0"], step=4, planned=False, reason="lost n1/0"),
            reconfigured(5.5, 2, "n0/0", resume=3, rolled=1),
            commit(5.7, 2, 3),
        ],
        [fault("kill-node", 5.0, "n2"), fault("kill-node", 5.25, "n1")],
        [
            ("kill-node", "n2", 1, 4, 0.1, 0.1, 0.7, 0, 0),
            ("kill-node", "n1", 2, 3, 0.05, 0.1, 0.45, 1, 1),
        ],
    ),
    "a fault nobody injected: the detection's cause, timed from the detection": (
        [
            detected(5.0, 0, "lease-expired", "n1"),
            agreed(5.2, 1, ["n0/0", "n2/0"], planned=False, reason="lost n1/0"),
            commit(5.5, 1, 3),
        ],
        [fault("drain-node", 1.0, "n2")],  # injected, but it explains no failure
        [("lease-expired", "n1", 1, None, 0.0, 0.2, 0.5, 0, None)],
    ),
    "a detector that knows when the fault happened starts there": (
        [
            detected(5.0, 0, "collective", "n0", fault_t=4.9),
            agreed(5.2, 1, ["n0/0", "n1/0"], **LOST_N2),
            commit(5.5, 1, 3),
        ],
        [],
        [("collective", "n0", 1, None, 0.1, 0.2, 0.6, 0, None)],
    ),
    "a stale detection of an older epoch does not start a later recovery": (
        [
            detected(5.0, 0, "collective", "n0"),
            agreed(5.2, 1, ["n0/0", "n1/0"], **LOST_N2),
            commit(5.5, 1, 3),
            detected(9.0, 0, "worker-exit", "n1"),  # late news of epoch 0
            detected(9.5, 1, "lease-expired", "n1"),
            agreed(9.7, 2, ["n0/0"], planned=False, reason="lost n1/0"),
            commit(9.9, 2, 8),
        ],
        [],
        [
            ("collective", "n0", 1, None, 0.0, 0.2, 0.5, 0, None),
            ("lease-expired", "n1", 2, None, 0.0, 0.2, 0.4, 0, None),
        ],
    ),
    "a fault on a node out of the job takes no later recovery": (
        [
            detected(10.1, 0, "snapshot-corrupt", "n2"),
            agreed(10.3, 1, ["n0/0", "n1/0"], **LOST_N2),
            commit(10.6, 1, 5),
            # n2 hung while out of the job: nobody lost, no recovery; then n1 is killed
            detected(40.2, 1, "worker-exit", "n1"),
            lost(40.4, 2, ["n0/0"], ["n1/0"]),
            commit(40.7, 2, 20),
            detected(60.3, 2, "worker-exit", "n0"),
            lost(60.5, 3, ["n0/0"], ["n0/0"]),
            commit(60.8, 3, 30),
        ],
        [
            fault("corrupt-snapshot", 10.0, "n2"),
            fault("hang-node", 20.0, "n2"),
            fault("kill-node", 40.0, "n1"),
            fault("kill-worker", 60.0, "n0"),
        ],
        [
            ("corrupt-snapshot", "n2", 1, None, 0.1, 0.2, 0.6, 0, 0),
            ("kill-node", "n1", 2, None, 0.2, 0.2, 0.7, 0, 2),
            ("kill-worker", "n0", 3, None, 0.3, 0.2, 0.8, 0, 3),
        ],
    ),
    "old logs: no admitted/removed (the reason names them), detections without epoch": (
        [
            {"t": 5.0, "kind": "fault-detected", "cause": "worker-exit", "node": "n1"},
            agreed(5.1, 1, ["n0/0", "n2/0"], planned=False, reason="lost n1/0"),
            commit(5.3, 1, 4),
            agreed(7.0, 2, MEMBERS, planned=True, reason="admit n1/0"),
            agreed(8.0, 3, ["n0/0", "n1/0", "n5/0"], planned=True, reason="admit n5/0; drain n2/0"),
            agreed(9.0, 4, ["n0/0", "n5/0"], planned=True, reason="drain n1/0"),
            commit(9.2, 4, 9),
        ],
        [fault("join-node", 7.5, "n5"), fault("kill-worker", 4.9, "n1")],
        [
            ("kill-worker", "n1", 1, None, 0.1, 0.1, 0.4, 0, 1),
            ("rejoin", "n1", 2, None, 0.0, 0.0, 2.2, 0, None),
            ("join-node", "n5", 3, None, 0.5, 0.0, 1.7, 0, 0),
            ("drain", "n1", 4, None, 0.0, 0.0, 0.2, 0, None),
        ],
    ),
    "planned changes nobody injected, and a failure whose detection is missing": (
        [
            planned(5.0, 1, [*MEMBERS, "n3/0"], admit="n3/0"),
            planned(6.0, 2, MEMBERS, drain="n3/0"),
            agreed(7.0, 3, ["n0/0", "n1/0"], planned=False, reason="lost n2/0", agree_s=0.3),
            commit(7.5, 3, 4),
        ],
        [],
        [
            ("join", "n3", 1, None, 0.0, 0.0, 2.5, 0, None),
            ("drain", "n3", 2, None, 0.0, 0.0, 1.5, 0, None),
            ("unknown", None, 3, None, 0.0, 0.3, 0.8, 0, None),
        ],
    ),
    # A fault whose effect came inside another's recovery is absorbed there (the tenth
    # field: the faults each record absorbed); left unused, it would explain a later
    # epoch it fits and time that recovery from its own, much earlier, injection.
    "two nodes lost in one epoch: the second fault takes no later recovery": (
        [
            detected(5.1, 0, "collective", "n0"),
            lost(5.2, 1, ["n0/0"], ["n1/0", "n2/0"], step=4),
            commit(5.5, 1, 4),
            planned(10.0, 2, ["n0/0", "n1/0"], admit="n1/0"),
            commit(10.2, 2, 8),
            detected(30.1, 2, "worker-exit", "n1"),
            lost(30.2, 3, ["n0/0"], ["n1/0"]),
            commit(30.4, 3, 20),
        ],
        [
            fault("kill-node", 5.0, "n2"),
            fault("kill-node", 5.05, "n1"),
            fault("kill-worker", 30.0, "n1"),
        ],
        [
            ("kill-node", "n2", 1, 4, 0.1, 0.1, 0.5, 0, 0, (1,)),
            ("rejoin", "n1", 2, None, 0.0, 0.0, 0.2, 0, None),
            ("kill-worker", "n1", 3, None, 0.1, 0.1, 0.4, 0, 2),
        ],
    ),
    "a drain inside a failure's recovery is absorbed; a later drain is its own node's": (
        [
            detected(5.1, 0, "worker-exit", "n0"),
            lost(5.2, 1, ["n0/0"], ["n1/0", "n2/0"], step=4),
            commit(5.5, 1, 4),
            planned(8.0, 2, ["n0/0", "n1/0"], admit="n1/0"),
            commit(8.2, 2, 6),
            {"t": 20.01, "kind": "drain-requested", "node": "n1"},
            planned(20.4, 3, ["n0/0"], drain="n1/0", step=15),
            commit(20.5, 3, 15),
        ],
        [
            fault("drain-node", 4.9, "n2"),
            fault("kill-worker", 5.0, "n1"),
            fault("drain-node", 20.0, "n1"),
        ],
        [
            ("kill-worker", "n1", 1, 4, 0.1, 0.1, 0.5, 0, 1, (0,)),
            ("rejoin", "n1", 2, None, 0.0, 0.0, 0.2, 0, None),
            ("drain-node", "n1", 3, 15, 0.4, 0.0, 0.5, 0, 2),
        ],
    ),
    "a join admitted with a failure is absorbed; its node back later is a rejoin": (
        [
            detected(7.1, 0, "worker-exit", "n0"),
            lost(7.2, 1, ["n0/0", "n2/0", "n3/0"], ["n1/0"], step=5, admitted=["n3/0"]),
            commit(7.5, 1, 5),
            detected(12.1, 1, "collective", "n0"),
            lost(12.2, 2, ["n0/0", "n2/0"], ["n3/0"], step=9),
            commit(12.4, 2, 9),
            planned(20.0, 3, ["n0/0", "n2/0", "n3/0"], admit="n3/0", step=15),
            commit(20.3, 3, 15),
        ],
        [
            fault("join-node", 2.0, "n3"),
            fault("kill-worker", 7.0, "n1"),
            fault("kill-node", 12.0, "n3"),
        ],
        [
            ("kill-worker", "n1", 1, 5, 0.1, 0.1, 0.5, 0, 1, (0,)),
            ("kill-node", "n3", 2, 9, 0.1, 0.1, 0.4, 0, 2),
            ("rejoin", "n3", 3, 15, 0.0, 0.0, 0.3, 0, None),
        ],
    ),
    "a fault with no effect of its own does not time a later one on its node": (
        [
            detected(30.1, 0, "worker-exit", "n0"),
            agreed(30.2, 1, ["n0/0", "n1/0"], step=20, **LOST_N2),
            commit(30.4, 1, 20),
        ],
        [fault("hang-node", 5.0, "n2"), fault("kill-worker", 30.0, "n2")],
        [("kill-worker", "n2", 1, 20, 0.1, 0.1, 0.4, 0, 1)],  # the hang: neither
    ),
    "a recovery still under way has no MTTR; unknown kinds are skipped": (
        [
            {"t": 4.0, "kind": "something-new", "epoch": "?"},
            detected(5.0, 0, "collective", "n0"),
            agreed(5.2, 1, ["n0/0", "n1/0"], **LOST_N2),
        ],
        [],
        [("collective", "n0", 1, None, 0.0, 0.2, None, 0, None)],
    ),
}


def brief(r: RecoveryRecord) -> tuple[Any, ...]:
    return (r.cause, r.node, r.epoch, r.step, r.detect_s, r.agree_s, r.mttr_s,
            r.rolled_back_steps, r.fault, r.absorbed)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_fold(case: str) -> None:
    events, faults, expected = CASES[case]
    got = [brief(r) for r in recoveries([*START, *events], faults)]
    assert len(got) == len(expected), got
    for have, want in zip(got, expected, strict=True):
        want = want if len(want) > 9 else (*want, ())  # absorbed nothing
        assert have[:4] == want[:4] and have[7:] == want[7:], have
        assert have[4:7] == pytest.approx(want[4:7], abs=1e-9), have


def test_the_order_of_events_does_not_matter() -> None:
    events, faults, _ = CASES[
        "a fault during a recovery: the first ends with the second's first commit"
    ]
    forward = recoveries([*START, *events], faults)
    assert recoveries(list(reversed([*START, *events])), faults) == forward


def test_a_record_carries_the_epoch_and_the_slowest_member() -> None:
    events, faults, _ = CASES["kill: timed from the fault, phases from the slowest member"]
    (r,) = recoveries([*START, *events], faults)
    assert (r.communicator_s, r.restore_s, r.replan_s) == (0.05, 0.03, 0.001)
    assert r.members == ("n0/0", "n1/0") and r.reason == "lost n2/0" and not r.planned
    assert (r.start_t, r.end_t) == (5.0, 5.6)
    assert r.reshard_s == 0.0 and r.reshard_bytes == 0  # full replicas: nothing resharded


def test_a_sharded_recovery_carries_its_slowest_reshard_and_all_bytes_moved() -> None:
    events, faults, _ = CASES["kill: timed from the fault, phases from the slowest member"]
    sharded = [
        {
            **e,
            "reshard_s": 0.02 if e.get("member") == "n0/0" else 0.025,
            "reshard_bytes": 1000 if e.get("member") == "n0/0" else 24,
        }
        if e["kind"] == "reconfigured"
        else e
        for e in events
    ]
    (r,) = recoveries([*START, *sharded], faults)
    assert r.reshard_s == 0.025 and r.restore_s == 0.03
    assert r.reshard_bytes == 1024 and r.reshard_bytes >= 0


def test_phases_tile_the_recovery_from_start_to_end() -> None:
    events, faults, _ = CASES["kill: timed from the fault, phases from the slowest member"]
    (r,) = recoveries([*START, *events], faults)
    tiled = phases(r)
    assert [p.name for p in tiled] == list(PHASES)
    assert tiled[0].start == r.start_t and tiled[-1].end == r.end_t
    assert all(a.end == b.start for a, b in itertools.pairwise(tiled))
    seconds = {p.name: p.seconds for p in tiled}
    assert seconds == pytest.approx(
        {"detect": 0.1, "agree": 0.2, "communicator": 0.05, "restore": 0.03,
         "replan": 0.001, "first-step": 0.219}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("end_t", "first_step", "last_end"),
    [
        (None, 0.0, 1.3),  # under way: the phases as measured, nothing after them
        (1.1, 0.0, 1.1),  # clock noise: the measured phases overrun the end, clamped to it
    ],
)
def test_phases_of_a_recovery_under_way_or_overrun(
    end_t: float | None, first_step: float, last_end: float
) -> None:
    r = RecoveryRecord(
        cause="collective", node="n0", epoch=1, step=None, detect_s=0.2, agree_s=0.3,
        communicator_s=0.4, restore_s=0.2, replan_s=0.2, mttr_s=end_t, rolled_back_steps=0,
        reason="", start_t=0.0, end_t=end_t,
    )  # fmt: skip
    tiled = phases(r)
    assert tiled[-1].seconds == pytest.approx(first_step)
    assert tiled[-1].end == pytest.approx(last_end)
    assert all(p.seconds >= 0 for p in tiled)


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        ({"kind": "commit"}, EventKind.COMMIT),
        ({"kind": "epoch-agreed"}, EventKind.EPOCH_AGREED),
        ({"kind": "something-new"}, None),  # a newer writer's kind
        ({"kind": 3}, None),
        ({}, None),
    ],
)
def test_kind_of(event: Event, kind: EventKind | None) -> None:
    assert kind_of(event) is kind
