"""Membership decisions are pure: the same observations give the same epoch and reason."""

from __future__ import annotations

import pytest

from keepstep.agent.node import agreement
from keepstep.agent.node.probe import ProbeResult
from keepstep.agent.protocol import EpochRecord

FOUR = ["n0/0", "n1/0", "n2/0", "n3/0"]


def alive(*members: str) -> dict[str, ProbeResult]:
    out: dict[str, ProbeResult] = {}
    for m in members:
        node = m.partition("/")[0]
        old = out.get(node)
        ready = (*(old.ready if old else ()), m)
        out[node] = ProbeResult(node, True, ready)
    return out


def test_first_epoch_waits_for_every_worker_then_the_grace() -> None:
    rec, why = agreement.first_epoch(FOUR[:3], 4, 2, waited_s=1.0, grace_s=30.0, now=0.0)
    assert rec is None and why == "waiting: 3 of 4 workers ready"
    rec, _ = agreement.first_epoch(FOUR, 4, 2, waited_s=1.0, grace_s=30.0, now=0.0)
    assert rec is not None and rec.members == FOUR and rec.epoch == 0
    rec, why = agreement.first_epoch(FOUR[:3], 4, 2, waited_s=31.0, grace_s=30.0, now=0.0)
    assert rec is not None and rec.members == FOUR[:3] and "3 of 4" in why


def test_boundary_admits_pending_and_drains_leaving_nodes() -> None:
    cur = EpochRecord(3, FOUR[:3])
    rec, why = agreement.at_boundary(cur, {"n3/0"}, {"n1"}, done=17, now=0.0)
    assert rec is not None
    assert rec.members == ["n0/0", "n2/0", "n3/0"] and rec.epoch == 4 and rec.start_step == 17
    assert why == "admit n3/0; drain n1/0"


def test_boundary_without_change_keeps_the_epoch() -> None:
    cur = EpochRecord(1, FOUR)
    assert agreement.at_boundary(cur, set(FOUR), set(), 5, 0.0) == (None, "no change")


def test_failure_keeps_members_whose_node_answers_and_offers_them() -> None:
    cur = EpochRecord(2, FOUR)
    probes = alive("n0/0", "n2/0", "n3/0")
    probes["n1"] = ProbeResult("n1", False, (), "unreachable: Connection refused")
    rec, why = agreement.after_failure(cur, probes, set(), set(), done=9, now=0.0)
    assert rec is not None and rec.members == ["n0/0", "n2/0", "n3/0"] and rec.epoch == 3
    assert why == "lost n1/0 (n1: unreachable: Connection refused)"


def test_failure_drops_a_crashed_worker_of_a_live_node_and_admits_ready_joiners() -> None:
    cur = EpochRecord(0, FOUR)
    probes = alive("n0/0", "n1/0", "n3/0", "n4/0")  # n2 answers without its worker
    probes["n2"] = ProbeResult("n2", True, ())
    rec, _ = agreement.after_failure(cur, probes, {"n4/0"}, set(), 3, 0.0)
    assert rec is not None and rec.members == ["n0/0", "n1/0", "n3/0", "n4/0"]


def test_failure_with_nobody_left_is_refused_with_a_reason() -> None:
    cur = EpochRecord(0, ["n0/0"])
    rec, why = agreement.after_failure(cur, {}, set(), set(), 0, 0.0)
    assert rec is None and why.endswith("no worker left to train")


def test_an_epoch_names_workers_this_node_does_not_offer() -> None:
    record = EpochRecord(4, ["n0/0", "n0/1", "n1/0"])
    assert agreement.not_offered(record, "n0", ["n0/1"]) == ["n0/0"]
    assert agreement.not_offered(record, "n0", ["n0/0", "n0/1"]) == []
    assert agreement.not_offered(record, "n2", []) == []


def test_a_failure_that_lost_nothing_raises_the_timeouts_up_to_a_cap() -> None:
    # A timeout fired although every member still answers (a loaded machine): the same
    # bounds would fire again, so each such epoch doubles them.
    cur = EpochRecord(4, FOUR)
    rec, why = agreement.after_failure(cur, alive(*FOUR), set(), set(), done=0, now=0.0)
    assert rec is not None and rec.members == FOUR and rec.timeout_scale == 2.0
    assert why == "lost nothing; timeouts raised to 2x (a timeout fired while all answered)"
    scales = []
    for _ in range(6):
        rec, _ = agreement.after_failure(rec, alive(*FOUR), set(), set(), done=0, now=0.0)
        assert rec is not None
        scales.append(rec.timeout_scale)
    assert scales == [4.0, 8.0, 16.0, 16.0, 16.0, 16.0]
    assert agreement.MAX_TIMEOUT_SCALE == 16.0


def test_a_real_loss_or_a_planned_change_keeps_the_raised_timeouts() -> None:
    cur = EpochRecord(4, FOUR, timeout_scale=4.0)
    probes = alive("n0/0", "n1/0", "n2/0")
    probes["n3"] = ProbeResult("n3", False, (), "unreachable: Connection refused")
    rec, why = agreement.after_failure(cur, probes, set(), set(), done=7, now=0.0)
    assert rec is not None and rec.timeout_scale == 4.0 and "raised" not in why
    rec, _ = agreement.at_boundary(cur, {"n4/0"}, set(), done=7, now=0.0)
    assert rec is not None and rec.timeout_scale == 4.0
    first, _ = agreement.first_epoch(FOUR, 4, 4, 0.0, 30.0, 0.0)
    assert first is not None and first.timeout_scale == 1.0


def test_only_nodes_that_let_the_probe_time_out_are_probed_again() -> None:
    probes = alive("n0/0")
    probes["n1"] = ProbeResult("n1", False, (), "no answer within 0.3 s (hung?)", timed_out=True)
    probes["n2"] = ProbeResult("n2", False, (), "unreachable: Connection refused")
    assert agreement.suspects(probes) == ["n1"]


def silent(*nodes: str) -> dict[str, ProbeResult]:
    return {
        n: ProbeResult(n, False, (), "no answer within 0.3 s (hung?)", 0.3, True) for n in nodes
    }


def refused(*nodes: str) -> dict[str, ProbeResult]:
    return {n: ProbeResult(n, False, (), "unreachable: Connection refused") for n in nodes}


def test_a_node_cut_off_from_most_of_the_epoch_leaves_the_decision_to_them() -> None:
    three = EpochRecord(7, ["n0/0", "n4/0", "n5/0"], "", 340, 0.0)
    # n5 is cut off: its probes of n0 and n4 time out, as a hung node's would.
    why = agreement.minority(three, {**alive("n5/0"), **silent("n0", "n4")})
    assert why is not None and "1 of the epoch's 3 live nodes answered (n0, n4 silent)" in why
    # The other side reaches two of three: it decides, and leaves n5 out.
    assert agreement.minority(three, {**alive("n0/0", "n4/0"), **silent("n5")}) is None
    # Killed nodes refuse the probe, and a node whose lease expired is not probed: neither
    # counts, so a lone survivor of real losses decides at once.
    assert agreement.minority(three, {**alive("n5/0"), **refused("n0", "n4")}) is None
    # n0 gone: n4 and n5 tie, and n4 comes first; once n4's lease expires too, n5 decides.
    assert agreement.minority(three, {**alive("n5/0"), **silent("n4")}) is not None
    assert agreement.minority(three, alive("n5/0")) is None


def test_a_tie_between_two_halves_is_decided_by_the_first_node() -> None:
    two = EpochRecord(3, ["n0/0", "n1/0"], "", 10, 0.0)
    assert agreement.minority(two, {**alive("n0/0"), **silent("n1")}) is None
    assert agreement.minority(two, {**alive("n1/0"), **silent("n0")}) is not None
    four = EpochRecord(3, FOUR, "", 10, 0.0)
    assert agreement.minority(four, {**alive("n0/0", "n1/0"), **silent("n2", "n3")}) is None
    assert agreement.minority(four, {**alive("n2/0", "n3/0"), **silent("n0", "n1")}) is not None


def test_an_epoch_missing_sharded_state_admits_a_worker_from_outside_it_or_none() -> None:
    # n1/0 restarted (its node kept its snapshot) while the others entered epoch 5 without
    # it: their sharded state has no copy among them, so only an epoch with n1/0 back helps.
    cur = EpochRecord(5, ["n0/0", "n2/0", "n3/0"], timeout_scale=2.0)
    assert agreement.newcomers(cur, {"n1/0", "n0/0"}, set()) == ["n1/0"]
    assert agreement.newcomers(cur, {"n1/0"}, {"n1"}) == []  # its node is draining
    probes = alive("n0/0", "n1/0", "n2/0", "n3/0")
    rec, why = agreement.after_failure(cur, probes, {"n1/0"}, set(), 9, 0.0, missing_state=True)
    assert rec is not None and rec.members == ["n0/0", "n1/0", "n2/0", "n3/0"]
    assert rec.timeout_scale == 2.0, "nothing timed out: the timeouts stay"
    assert rec.checkpoint_step == -1, "n1/0 brings the state: no fallback"
    assert why == "lost nothing; admit n1/0 for the missing sharded state"
    # The same members again would find the same state missing: no epoch, and why.
    rec, why = agreement.after_failure(cur, probes, set(), set(), 9, 0.0, missing_state=True)
    assert rec is None and why.endswith("sharded state is missing and no other worker is ready")


def test_after_failure_falls_back_to_the_checkpoint_when_no_worker_can_bring_the_state() -> None:
    cur = EpochRecord(5, ["n0/0", "n3/0"], timeout_scale=2.0)
    probes = alive("n0/0", "n3/0")
    gone = (8, "every worker that could hold it is gone with its node")
    rec, why = agreement.after_failure(cur, probes, set(), set(), 11, 0.0, True, gone)
    assert rec is not None and rec.members == ["n0/0", "n3/0"] and rec.epoch == 6
    assert rec.checkpoint_step == 8 and rec.start_step == 11
    assert rec.timeout_scale == 2.0, "nothing timed out: the timeouts stay"
    assert why == (
        "lost nothing; sharded state lost (every worker that could hold it is gone with its "
        "node): all resume from the durable checkpoint of step 8"
    )
    # A plain failure never falls back, whatever it is given.
    rec, _ = agreement.after_failure(cur, probes, set(), set(), 11, 0.0, False, gone)
    assert rec is not None and rec.checkpoint_step == -1


@pytest.mark.parametrize(
    ("nodes", "nproc", "pending", "gone"),
    [
        (["n0", "n3"], 1, set(), True),  # every live worker is a member
        (["n0", "n1", "n3"], 1, set(), False),  # n1/0 may be restarting from its snapshot
        (["n0", "n3"], 2, set(), False),  # n0/1 is outside the epoch, on a live node
        (["n0", "n3"], 1, {"n5/0"}, False),  # one is waiting to be admitted
        ([], 1, set(), True),
    ],
)
def test_state_holders_gone(nodes: list[str], nproc: int, pending: set[str], gone: bool) -> None:
    cur = EpochRecord(5, ["n0/0", "n3/0"])
    assert agreement.state_holders_gone(cur, nodes, nproc, pending) is gone
    outside = agreement.outside_nodes(cur, nodes, nproc)
    assert (not outside) is (gone or bool(pending))
