"""The invariants, on synthetic runs: a clean one holds them all, each breach is caught."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from keepstep.agent.protocol.events import EventKind
from keepstep.chaos.invariants import (
    INVARIANTS,
    Observation,
    Reference,
    Verdict,
    check,
    reference_from,
)
from keepstep.chaos.model import Checks, Job

JOB = Job(script="train.py", nodes=2, global_batch=8, micro_batch=2, steps=6)
CHECKS = Checks(detection_bound_s=2.0, shutdown_bound_s=5.0)
T0 = 1000.0


def make_run(
    epochs: dict[int, int] | None = None, dt: float = 0.1
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A two-member run; `epochs` maps a step to the epoch it was (re)committed in,
    with an epoch-agreed event and a recovery record for every epoch above 0."""
    epochs = epochs or {}
    events: list[dict[str, Any]] = []
    t = T0
    recoveries = []
    agreed: set[int] = set()
    for step in range(JOB.steps):
        epoch = epochs.get(step, 0)
        if epoch and epoch not in agreed:
            agreed.add(epoch)
            events.append({"t": t, "kind": "epoch-agreed", "epoch": epoch, "members": []})
            recoveries.append(
                {"epoch": epoch, "cause": "kill-worker", "node": "n1", "detect_s": 0.1,
                 "agree_s": 0.01, "communicator_s": 0.01, "restore_s": 0.01, "replan_s": 0.0,
                 "mttr_s": 0.2, "rolled_back_steps": 0}
            )  # fmt: skip
        t += dt
        assignment = {"n0/0": [0, 1], "n1/0": [2, 3]}
        for member, mbs in assignment.items():
            samples = [step * 8 + mb * 2 + k for mb in mbs for k in range(2)]
            events.append(
                {"t": t, "kind": "commit", "member": member, "step": step, "epoch": epoch,
                 "world_size": 2, "micro_batches": mbs, "samples": samples,
                 "assignment": assignment}
            )  # fmt: skip
    for member in ("n0/0", "n1/0"):
        events.append({"t": t + 0.01, "kind": "finish", "member": member, "done": JOB.steps})
    summary = {
        "params_sha256": "abc",
        "params_sha256_disagree": [],
        "steps": JOB.steps,
        "global_batch": JOB.global_batch,
        "world_size_by_step": [2] * JOB.steps,
        "recoveries": recoveries,
        "samples": {"expected": 48, "seen_once": 48, "lost": 0, "duplicated": 0,
                    "plan_mismatches": []},
        "agent_exit_codes": {"n0": 0, "n1": 0},
        "faults": [],
    }  # fmt: skip
    return summary, events


def reference() -> Reference:
    summary, events = make_run()
    return reference_from(summary, events, JOB)


def verdict(
    summary: dict[str, Any] | None,
    events: list[dict[str, Any]],
    seen: Observation | None = None,
    checks: Checks = CHECKS,
) -> Verdict:
    end = max(e["t"] for e in events) + 1.0
    return check(summary, events, reference(), seen or Observation(0, end), JOB, checks)


def broken(v: Verdict) -> set[str]:
    return {name for name, ok in v.invariants.items() if not ok}


def test_a_clean_run_holds_every_invariant() -> None:
    summary, events = make_run()
    v = verdict(summary, events)
    assert v.passed and v.violations == []
    assert set(v.invariants) == set(INVARIANTS)
    assert v.goodput["ratio"] == pytest.approx(1.0)


def test_a_run_with_a_recorded_recovery_holds_them_too() -> None:
    summary, events = make_run({s: 1 for s in range(3, 6)})
    fault = {"index": 0, "kind": "kill-worker", "spec": "kill-worker:1@step=3", "node": "n1",
             "t": T0 + 0.25}  # fmt: skip
    v = verdict(summary, events, Observation(0, T0 + 3, (fault,)))
    assert v.passed, v.violations


def test_different_parameters() -> None:
    summary, events = make_run()
    summary["params_sha256"] = "def"
    v = verdict(summary, events)
    assert broken(v) == {"final_parameters_equal"}
    assert "differs from the fault-free run's abc" in v.violations[0]


def test_no_summary_at_all() -> None:
    _, events = make_run()
    v = verdict(None, events)
    assert broken(v) == {"final_parameters_equal"}
    assert "wrote no summary" in " ".join(v.violations)


def test_a_member_that_computed_less_than_its_share() -> None:
    summary, events = make_run()
    commit = next(e for e in events if e["kind"] == EventKind.COMMIT and e["step"] == 2)
    commit["micro_batches"] = [0]
    commit["samples"] = commit["samples"][:2]
    v = verdict(summary, events)
    assert broken(v) == {"global_batch_constant"}
    assert "step 2: n0/0 computed [0], not its share" in v.violations[0]


def test_a_plan_that_leaves_out_a_micro_batch() -> None:
    summary, events = make_run()
    for e in events:
        if e["kind"] == EventKind.COMMIT and e["step"] == 3:
            e["assignment"] = {"n0/0": [0, 1], "n1/0": [2]}
            if e["member"] == "n1/0":
                e["micro_batches"], e["samples"] = [2], e["samples"][:2]
    v = verdict(summary, events)
    assert "global_batch_constant" in broken(v)
    assert "step 3: planned micro-batches [0, 1, 2]" in v.violations[0]


def test_a_step_never_committed() -> None:
    summary, events = make_run()
    events = [e for e in events if not (e["kind"] == EventKind.COMMIT and e["step"] == 5)]
    v = verdict(summary, events)
    assert "global_batch_constant" in broken(v)
    assert "step 5: never committed" in " ".join(v.violations)


def test_a_member_killed_before_reporting_its_commit_is_no_violation() -> None:
    """Its share went into the sum (the others committed the step): only its record is
    missing, as when a worker is killed between the collective and its report."""
    summary, events = make_run()
    events = [
        e
        for e in events
        if not (e["kind"] == EventKind.COMMIT and e["step"] == 4 and e["member"] == "n1/0")
    ]
    assert verdict(summary, events).passed


def test_a_duplicated_sample_in_the_ledger() -> None:
    summary, events = make_run()
    summary["samples"]["duplicated"] = 2
    assert broken(verdict(summary, events)) == {"every_sample_once"}


def test_other_samples_than_the_reference() -> None:
    summary, events = make_run()
    commit = next(e for e in events if e["kind"] == EventKind.COMMIT and e["step"] == 4)
    commit["samples"] = [s + 1 for s in commit["samples"]]
    v = verdict(summary, events)
    assert broken(v) == {"every_sample_once"}
    assert "(step, micro-batch) [(4, 0), (4, 1)] used other samples" in v.violations[0]


def test_a_pause_longer_than_the_detection_bound() -> None:
    summary, events = make_run()
    for e in events:
        if e["kind"] in (EventKind.COMMIT, EventKind.FINISH) and e.get("step", 99) >= 3:
            e["t"] += 2.5
    v = verdict(summary, events)
    assert broken(v) == {"no_hang_beyond_bound"}
    assert "no step committed for 2.6 s" in v.violations[0]


def test_a_slow_shutdown() -> None:
    summary, events = make_run()
    end = max(e["t"] for e in events) + 6.0
    v = verdict(summary, events, Observation(0, end))
    assert broken(v) == {"no_hang_beyond_bound"}
    assert "ended 6.0 s after its first member finished" in v.violations[0]


def test_a_process_left_behind() -> None:
    summary, events = make_run()
    seen = Observation(0, T0 + 2, leftovers=("process 42 of node n1: python train.py",))
    v = verdict(summary, events, seen)
    assert broken(v) == {"no_process_left_behind"}


def test_an_epoch_without_a_recovery_record() -> None:
    summary, events = make_run({s: 1 for s in range(3, 6)})
    summary["recoveries"] = []
    v = verdict(summary, events)
    assert broken(v) == {"every_recovery_recorded"}
    assert "epoch 1 has no recovery record" in v.violations[0]


def test_an_incomplete_recovery_record() -> None:
    summary, events = make_run({s: 1 for s in range(3, 6)})
    summary["recoveries"][0]["mttr_s"] = None
    v = verdict(summary, events)
    assert broken(v) == {"every_recovery_recorded"}
    assert "epoch 1 (kill-worker: None): recovery record without mttr_s" in v.violations[0]


def test_a_member_restarted_after_the_job_finished() -> None:
    """A worker that crashed on its way out was restarted and agreed an epoch of its own."""
    summary, events = make_run()
    end = max(e["t"] for e in events)
    events += [
        {"t": end + 20.0, "kind": "epoch-agreed", "epoch": 1, "members": ["n0/0"]},
        {"t": end + 20.1, "kind": "finish", "member": "n0/0", "done": JOB.steps},
    ]
    summary["recoveries"] = [
        {"epoch": 1, "cause": "worker-exit", "reason": "lost n1/0", "detect_s": 0.0,
         "agree_s": 20.0, "communicator_s": 0.0, "restore_s": 0.0, "replan_s": 0.0,
         "mttr_s": None}
    ]  # fmt: skip
    v = verdict(summary, events, Observation(0, end + 21), Checks(2.0, shutdown_bound_s=45.0))
    assert broken(v) == {"every_recovery_recorded"}
    assert "after the first member finished" in v.violations[0]


def test_a_fault_nobody_recovered_from() -> None:
    summary, events = make_run()
    fault = {"index": 3, "kind": "kill-node", "spec": "kill-node:1@time=1s", "node": "n1",
             "t": T0 + 0.2}  # fmt: skip
    v = verdict(summary, events, Observation(0, T0 + 3, (fault,)))
    assert broken(v) == {"every_recovery_recorded"}
    assert "fault #3 kill-node:1@time=1s" in v.violations[0]


def test_a_fault_on_a_node_the_job_had_left_out_needs_no_recovery() -> None:
    """Seen in the 1,000-fault campaign: n5 excluded after a partition, then killed."""
    summary, events = make_run()
    events.insert(0, {"t": T0, "kind": "epoch-agreed", "epoch": 0, "members": ["n0/0", "n1/0"]})
    fault = {"index": 3, "kind": "kill-node", "spec": "kill-node:1@time=1s", "node": "n1",
             "t": T0 + 0.2}  # fmt: skip
    v = verdict(summary, events, Observation(0, T0 + 3, (fault,)))
    assert any("fault #3" in line for line in v.violations)
    events.insert(1, {"t": T0 + 0.1, "kind": "epoch-agreed", "epoch": 1, "members": ["n0/0"]})
    v = verdict(summary, events, Observation(0, T0 + 3, (fault,)))
    assert not any("fault #3" in line for line in v.violations), v.violations


def test_faults_that_need_no_recovery_are_not_matched() -> None:
    summary, events = make_run()
    faults = (
        {"index": 0, "kind": "slow-node", "spec": "slow-node:1@step=2", "node": "n1", "t": T0},
        {"index": 1, "kind": "kill-node", "spec": "kill-node:1@step=2", "node": "n1", "t": None,
         "skipped": "node n1 is not running"},
    )  # fmt: skip
    assert verdict(summary, events, Observation(0, T0 + 3, faults)).passed


def test_an_agent_that_failed() -> None:
    summary, events = make_run()
    summary["agent_exit_codes"]["n1"] = 1
    v = verdict(summary, events)
    assert broken(v) == {"clean_exit"}
    assert "agent n1 exited with 1" in v.violations[0]


def test_a_killed_node_may_exit_by_its_signal() -> None:
    summary, events = make_run({s: 1 for s in range(3, 6)})
    summary["agent_exit_codes"]["n1"] = -9
    fault = {"index": 0, "kind": "kill-node", "spec": "kill-node:1@step=3", "node": "n1",
             "t": T0 + 0.25}  # fmt: skip
    assert verdict(summary, events, Observation(0, T0 + 3, (fault,))).passed


def test_the_launcher_may_fail_only_for_the_agents_the_harness_killed() -> None:
    # The launcher did not inject the harness's kill, so it counts n1's signal as a failure
    # and exits 1: that alone is not a violation; any other failure still is.
    summary, events = make_run({s: 1 for s in range(3, 6)})
    summary["agent_exit_codes"]["n1"] = -9
    summary["failures"] = ["agent n1 exited with signal SIGKILL"]
    fault = {"index": 0, "kind": "kill-node", "spec": "kill-node:1@step=3", "node": "n1",
             "t": T0 + 0.25}  # fmt: skip
    assert verdict(summary, events, Observation(1, T0 + 3, (fault,))).passed
    summary["failures"].append("agent n0 exited with code 1")
    v = verdict(summary, events, Observation(1, T0 + 3, (fault,)))
    assert broken(v) == {"clean_exit"}
    assert v.violations == ["clean_exit: keepstep run exited with 1"]


def test_a_launcher_that_failed() -> None:
    summary, events = make_run()
    assert broken(verdict(summary, events, Observation(1, T0 + 2))) == {"clean_exit"}


def test_goodput_target() -> None:
    summary, events = make_run(dt=0.2)  # half the fault-free run's speed
    v = verdict(summary, events, checks=Checks(2.0, 5.0, min_goodput=0.95))
    assert broken(v) == {"goodput_target"}
    assert v.goodput["ratio"] == pytest.approx(0.5, rel=0.05)
    assert verdict(*make_run(), checks=Checks(2.0, 5.0, min_goodput=0.95)).passed


def test_the_checks_do_not_change_their_inputs() -> None:
    summary, events = make_run({s: 1 for s in range(3, 6)})
    before = copy.deepcopy((summary, events))
    verdict(summary, events)
    assert (summary, events) == before


def test_a_reference_must_have_finished() -> None:
    summary, events = make_run()
    summary["params_sha256"] = None
    with pytest.raises(ValueError, match="did not finish cleanly"):
        reference_from(summary, events, JOB)


def test_checkpoints_locate_where_the_numbers_left_the_reference() -> None:
    ref_summary, ref_events = make_run()
    ref = reference_from(ref_summary, ref_events, JOB, ((2, "a"), (4, "b"), (6, "c")))
    summary, events = make_run()
    summary["params_sha256"] = "def"
    seen = Observation(0, T0 + 2, checkpoints=((2, "a"), (4, "x"), (6, "y")))
    v = check(summary, events, ref, seen, JOB, CHECKS)
    assert broken(v) == {"final_parameters_equal"}
    assert any(
        "first differs at the checkpoint of step 4 (equal at step 2)" in x for x in v.violations
    )


def test_a_sharded_jobs_checkpoints_are_not_compared_with_full_replicas() -> None:
    # Its checkpoint records hash the parts' manifest: equal parameters are not a violation.
    sharded = dataclasses.replace(JOB, shard="zero1")
    ref_summary, ref_events = make_run()
    ref = reference_from(ref_summary, ref_events, sharded, ((2, "a"), (4, "b")))
    summary, events = make_run()
    seen = Observation(0, T0 + 2, checkpoints=((2, "m1"), (4, "m2")))
    equal = check(summary, events, ref, seen, sharded, CHECKS)
    assert "final_parameters_equal" not in broken(equal), equal.violations
    summary["params_sha256"] = "def"  # a real difference still is one
    assert "final_parameters_equal" in broken(check(summary, events, ref, seen, sharded, CHECKS))
