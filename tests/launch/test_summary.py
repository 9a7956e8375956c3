"""The run summary: ledger and recovery attribution from synthetic event logs."""

from __future__ import annotations

from typing import Any

from keepstep.launch.summary import build_summary, micro_batches_at

PLAN4 = {"n0/0": [0], "n1/0": [1], "n2/0": [2], "n3/0": [3]}
PLAN3 = {"n0/0": [0, 1], "n1/0": [2], "n3/0": [3]}


def commit(
    t: float, member: str, step: int, epoch: int, plan: dict[str, list[int]]
) -> dict[str, Any]:
    return {
        "t": t,
        "kind": "commit",
        "member": member,
        "step": step,
        "epoch": epoch,
        "world_size": len(plan),
        "micro_batches": plan[member],
        "assignment": plan,
    }


def test_a_join_injected_early_is_not_blamed_for_a_later_kill() -> None:
    events = [
        {"t": 0.0, "kind": "epoch-agreed", "epoch": 0, "members": list(PLAN4)},
        commit(1.0, "n0/0", 0, 0, PLAN4),
        {"t": 5.0, "kind": "fault-detected", "cause": "collective", "node": "n0", "epoch": 0},
        {"t": 5.01, "kind": "epoch-agreed", "epoch": 1, "planned": False, "reason": "lost n2/0"},
        commit(5.2, "n0/0", 1, 1, PLAN3),
        {"t": 9.0, "kind": "epoch-agreed", "epoch": 2, "planned": True, "reason": "admit n4/0"},
    ]
    faults = [
        {"kind": "join-node", "node": "n4", "t": 0.5},
        {"kind": "kill-node", "node": "n2", "t": 4.99},
    ]
    s = build_summary(events, faults, steps=2, global_batch=16, micro_batch=4)
    kill, join = s["recoveries"]
    assert kill["cause"] == "kill-node" and kill["node"] == "n2"
    assert abs(kill["mttr_s"] - 0.21) < 1e-6 and abs(kill["detect_s"] - 0.01) < 1e-6
    assert join["cause"] == "join-node" and join["mttr_s"] is None
    assert s["samples"] == {
        "expected": 32,
        "seen_once": 32,
        "lost": 0,
        "duplicated": 0,
        "plan_mismatches": [],
    }


def test_a_member_that_computed_other_than_its_plan_is_reported() -> None:
    bad = commit(1.0, "n1/0", 0, 0, PLAN4)
    bad["micro_batches"] = [2]
    s = build_summary([bad], [], steps=1, global_batch=16, micro_batch=4)
    assert s["samples"]["plan_mismatches"] == ["step 0: n1/0 computed [2], planned [1]"]


def test_a_rejoin_names_its_node_and_a_join_is_matched_to_its_own_node() -> None:
    # n3's worker was killed and came back (admitted first); the joined node n4 came later.
    events = [
        {"t": 0.0, "kind": "epoch-agreed", "epoch": 0, "members": list(PLAN4)},
        {"t": 5.0, "kind": "fault-detected", "cause": "worker-exit", "node": "n3", "epoch": 0},
        {"t": 5.01, "kind": "epoch-agreed", "epoch": 1, "planned": False, "reason": "lost n3/0"},
        {
            "t": 8.0,
            "kind": "epoch-agreed",
            "epoch": 2,
            "planned": True,
            "reason": "admit n3/0",
            "admitted": ["n3/0"],
            "removed": [],
        },
        # Written before events carried `admitted`: the reason names the member.
        {"t": 9.0, "kind": "epoch-agreed", "epoch": 3, "planned": True, "reason": "admit n4/0"},
    ]
    faults = [
        {"kind": "kill-worker", "node": "n3", "t": 4.99},
        {"kind": "join-node", "node": "n4", "t": 6.0},
    ]
    s = build_summary(events, faults, steps=0, global_batch=16, micro_batch=4)
    got = [(r["epoch"], r["cause"], r["node"]) for r in s["recoveries"]]
    assert got == [(1, "kill-worker", "n3"), (2, "rejoin", "n3"), (3, "join-node", "n4")]


def test_metrics_come_from_the_commit_that_stands() -> None:
    # Step 1 was committed in epoch 0 (loss 9.0), rolled back and redone in epoch 1: the
    # redo stands. Step 2 logged nothing; every member of an epoch reports the same values.
    def logged(t: float, member: str, step: int, epoch: int, **metrics: float) -> dict[str, Any]:
        plan = PLAN4 if epoch == 0 else PLAN3
        return {**commit(t, member, step, epoch, plan), "metrics": metrics, "skipped": False}

    events = [
        logged(1.0, "n0/0", 0, 0, loss=2.0, acc=0.5),
        logged(1.01, "n1/0", 0, 0, loss=2.0, acc=0.5),
        logged(2.0, "n0/0", 1, 0, loss=9.0, acc=0.1),
        logged(3.0, "n0/0", 1, 1, loss=1.5, acc=0.75),
        logged(3.01, "n3/0", 1, 1, loss=1.5, acc=0.75),
        {**logged(4.0, "n0/0", 2, 1), "skipped": True},
    ]
    s = build_summary(events, [], steps=4, global_batch=16, micro_batch=4)
    assert s["metrics"] == {"acc": [0.5, 0.75, None, None], "loss": [2.0, 1.5, None, None]}
    assert s["skipped_steps"] == [2]
    assert s["world_size_by_step"] == [4, 3, 3, 0]
    # Nobody finished: 0 steps finished, 3 committed (steps 0-2).
    assert (s["steps"], s["committed_steps"]) == (0, 3)


def test_a_run_that_logged_nothing_has_no_metrics() -> None:
    # Commits written before they carried metrics (no `metrics`, no `skipped`).
    events = [commit(1.0, "n0/0", 0, 0, PLAN4), commit(2.0, "n0/0", 1, 0, PLAN4)]
    s = build_summary(events, [], steps=2, global_batch=16, micro_batch=4)
    assert (s["metrics"], s["skipped_steps"]) == ({}, [])


def test_micro_batches_by_step_is_run_length_encoded_from_the_standing_plans() -> None:
    even = {"n0/0": [0, 1], "n1/0": [2, 3]}
    weighted = {"n0/0": [0, 1, 2], "n1/0": [3]}
    events = [commit(float(s), "n0/0", s, 0, even if s < 3 else weighted) for s in range(5)]
    # Step 4 was redone in epoch 1 on n0/0 alone: the redone plan stands.
    events.append(commit(9.0, "n0/0", 4, 1, {"n0/0": [0, 1, 2, 3]}))
    s = build_summary(events, [], steps=5, global_batch=8, micro_batch=2)
    spans = s["micro_batches_by_step"]
    assert spans == [
        {"steps": [0, 2], "counts": {"n0/0": 2, "n1/0": 2}},
        {"steps": [3, 3], "counts": {"n0/0": 3, "n1/0": 1}},
        {"steps": [4, 4], "counts": {"n0/0": 4}},
    ]
    assert micro_batches_at(spans, 1) == {"n0/0": 2, "n1/0": 2}
    assert micro_batches_at(spans, 3) == {"n0/0": 3, "n1/0": 1}
    assert micro_batches_at(spans, 5) is None
    assert s["samples"]["lost"] == 0 and s["samples"]["duplicated"] == 0


def test_a_gap_starts_a_new_run() -> None:
    plan = {"n0/0": [0, 1]}
    events = [commit(float(s), "n0/0", s, 0, plan) for s in (0, 1, 3)]
    s = build_summary(events, [], steps=4, global_batch=4, micro_batch=2)
    assert [span["steps"] for span in s["micro_batches_by_step"]] == [[0, 1], [3, 3]]


def test_weight_changes_are_listed_once_each_in_order() -> None:
    change = {
        "kind": "weights-changed",
        "member": "n0/0",
        "epoch": 0,
        "step": 9,
        "old": {"n0/0": 1.0, "n1/0": 1.0},
        "new": {"n0/0": 1.0, "n1/0": 0.33},
        "counts": {"n0/0": 2, "n1/0": 2},
    }
    later = {**change, "step": 20, "old": change["new"], "new": change["old"]}
    events = [{**later, "t": 3.0}, {**change, "t": 1.0}, {**change, "t": 1.5}]
    s = build_summary(events, [], steps=1, global_batch=4, micro_batch=2)
    assert [(c["step"], c["new"]["n1/0"]) for c in s["weight_changes"]] == [(9, 0.33), (20, 1.0)]
    assert set(s["weight_changes"][0]) == {"epoch", "step", "old", "new", "counts"}


def test_a_slowed_node_is_not_blamed_for_a_recovery() -> None:
    events = [
        {"t": 0.0, "kind": "epoch-agreed", "epoch": 0, "members": list(PLAN4)},
        commit(1.0, "n0/0", 0, 0, PLAN4),
        {"t": 5.0, "kind": "fault-detected", "cause": "lease-expired", "node": "n2", "epoch": 0},
        {"t": 5.01, "kind": "epoch-agreed", "epoch": 1, "planned": False, "reason": "lost n2/0"},
        commit(5.2, "n0/0", 1, 1, PLAN3),
    ]
    faults = [{"kind": "slow-node", "node": "n2", "t": 4.0, "factor": 3.0}]
    s = build_summary(events, faults, steps=2, global_batch=16, micro_batch=4)
    (r,) = s["recoveries"]
    assert r["cause"] == "lease-expired"  # a false alarm shows as one
    assert s["faults"] == faults


def test_a_fallback_to_the_checkpoint_is_listed_and_its_rerun_steps_count_once() -> None:
    two = {"n1/0": [0, 1], "n3/0": [2, 3]}
    events: list[dict[str, Any]] = [
        *(commit(0.1 * s, m, s, 0, PLAN4) for s in range(4) for m in PLAN4),
        {
            "t": 1.0,
            "kind": "epoch-agreed",
            "epoch": 2,
            "members": ["n1/0", "n3/0"],
            "reason": "lost nothing; sharded state lost (...): all resume from the durable "
            "checkpoint of step 2",
            "step": 4,
            "checkpoint_step": 2,
        },
        {"t": 1.1, "kind": "epoch-agreed", "epoch": 1, "members": ["n1/0", "n3/0"], "step": 4},
        # Steps 2 and 3 trained again after the fallback, then step 4.
        *(commit(2.0 + 0.1 * s, m, s, 2, two) for s in (2, 3, 4) for m in two),
    ]
    s = build_summary(events, [], steps=5, global_batch=16, micro_batch=4)
    [fallback] = s["fallbacks"]
    assert fallback["epoch"] == 2 and fallback["checkpoint_step"] == 2
    assert (fallback["step"], fallback["rerun_steps"]) == (4, 2)
    assert "durable checkpoint of step 2" in fallback["reason"]
    assert s["samples"]["lost"] == s["samples"]["duplicated"] == 0
    assert s["world_size_by_step"] == [4, 4, 2, 2, 2]


def test_a_joined_node_that_trained_no_step_is_listed() -> None:
    plan5 = {**PLAN4, "n4/0": [4]}
    events = [commit(1.0, "n0/0", 0, 0, PLAN4), commit(3.0, "n0/0", 1, 1, plan5)]
    faults = [
        {"kind": "join-node", "node": "n4", "step": 0, "t": 0.5},  # trained step 1
        {"kind": "join-node", "node": "n5", "step": 1, "t": 2.5},  # came too late
        {"kind": "join-node", "node": "n6", "step": 1},  # never injected
    ]
    s = build_summary(events, faults, steps=2, global_batch=20, micro_batch=4)
    assert s["joins_unused"] == [{"node": "n5", "step": 1}]
