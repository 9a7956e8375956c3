"""The long campaign's schedule (rejoin after N steps, hang methods, partitions and etcd
member kills drawn at random) and its tally of faults by kind."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections import Counter
from pathlib import Path

import pytest

from keepstep.chaos.model import FaultKind, RandomFaults, Trigger
from keepstep.chaos.scenario import load_scenario, parse_scenario
from keepstep.chaos.schedule import expand
from keepstep.chaos.tally import DURING_RECOVERY, by_kind, label, unexplained
from keepstep.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CAMPAIGN = REPO / "e2e" / "scenarios" / "campaign-1000.yaml"


def test_the_campaign_draws_1000_faults_over_at_least_ten_kinds() -> None:
    s = load_scenario(CAMPAIGN)
    plans = expand(s)
    kinds = Counter(label(f, s.job) for p in plans for f in p.faults)
    assert sum(kinds.values()) >= 1000
    assert len(kinds) >= 10, kinds
    for name in ("hang-node/signal", "hang-node/freezer", "partition-node", "kill-etcd/member"):
        assert kinds[name] > 0, name
    assert any(f.at.during_recovery_of is not None for p in plans for f in p.faults)


def test_a_node_is_hit_again_only_after_rejoin_steps_and_one_always_stays() -> None:
    s = load_scenario(CAMPAIGN)
    gap = s.random.rejoin_steps if s.random else None
    assert gap is not None
    for plan in expand(s):
        last: dict[int, int] = {}
        gone: set[int] = set()
        joins = 0
        for f in plan.faults:
            step = _step(plan.faults, f.at)
            if f.kind is FaultKind.JOIN_NODE:
                joins += 1
                continue
            if f.node is None:
                continue
            assert f.node < s.job.nodes, "joined nodes are never targets"
            assert f.node not in gone, f"{f} hits a node removed for good"
            if f.node in last and f.kind is not FaultKind.SLOW_NODE:
                assert step - last[f.node] >= gap, f"{f} within {gap} steps of the last hit"
            if f.kind is not FaultKind.SLOW_NODE:
                last[f.node] = step
            if f.kind.removes_node and f.duration is None:
                gone.add(f.node)
        assert len(gone) <= s.job.nodes - 1


def _step(faults: tuple, at: Trigger) -> int:  # type: ignore[type-arg]
    while at.step is None:
        assert at.during_recovery_of is not None
        at = faults[at.during_recovery_of].at
    return at.step


def test_etcd_member_kills_are_spaced_and_a_lone_etcd_keeps_its_quiet() -> None:
    s = load_scenario(CAMPAIGN)
    for plan in expand(s):
        kills = [_step(plan.faults, f.at) for f in plan.faults if f.kind is FaultKind.KILL_ETCD]
        assert all(b - a >= 50 for a, b in itertools.pairwise(kills)), kills
    lone = dataclasses.replace(s, job=dataclasses.replace(s.job, etcd_members=1))
    for plan in expand(lone)[:5]:
        steps = [_step(plan.faults, f.at) for f in plan.faults]
        for i, f in enumerate(plan.faults):
            if f.kind is FaultKind.KILL_ETCD:
                later = [t for t in steps[i + 1 :] if t > steps[i]]
                assert not later or later[0] - steps[i] >= 50


def test_hang_methods_are_drawn_only_when_listed() -> None:
    s = load_scenario(REPO / "e2e" / "scenarios" / "random-100.yaml")
    hangs = [f for p in expand(s) for f in p.faults if f.kind is FaultKind.HANG_NODE]
    assert hangs and all(f.method is None and f.native for f in hangs if f.at.step)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hang_methods": ("sigstop",)}, "hang_methods: 'sigstop'; allowed: signal, freezer"),
        ({"rejoin_steps": 0}, "rejoin_steps 0 must be >= 1"),
        ({"partition_duration": 0.0}, "partition_duration 0.0 must be > 0 seconds"),
        ({"kinds": (FaultKind.RESTART_OPERATOR,)}, "restart-operator cannot be drawn"),
    ],
)
def test_bad_random_options_name_the_value(options: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"count": 3, "kinds": (FaultKind.KILL_WORKER,)}
    with pytest.raises(ConfigError, match=message):
        RandomFaults(**(base | options))  # type: ignore[arg-type]


def test_a_bad_hang_method_in_a_file_names_its_line() -> None:
    text = CAMPAIGN.read_text().replace("[signal, freezer]", "[signal, freeze]")
    with pytest.raises(ConfigError, match=r":\d+: hang_methods: 'freeze'"):
        parse_scenario(text)


def test_the_tally_counts_kinds_inside_recoveries_and_times_each_fault_once() -> None:
    s = load_scenario(CAMPAIGN)
    plan = next(p for p in expand(s) if any(f.at.during_recovery_of for f in p.faults))
    inside = next(i for i, f in enumerate(plan.faults) if f.at.during_recovery_of is not None)
    faults = [
        {"run": plan.index, "index": i, "t": 10.0 + i if i != 1 else None}
        for i in range(len(plan.faults))
    ]
    recoveries = [
        # Two recoveries follow fault 0: the first (lower epoch) times it.
        {"run": plan.index, "epoch": 3, "fault": 0, "mttr_from_fault_s": 9.0},
        {
            "run": plan.index,
            "epoch": 2,
            "fault": 0,
            "mttr_from_fault_s": 1.0,
            "detect_from_fault_s": 0.5,
        },
        {"run": plan.index, "epoch": 4, "fault": inside, "mttr_from_fault_s": 2.0},
        {"run": plan.index, "epoch": 5, "mttr_from_fault_s": 7.0},  # explained by no fault
    ]
    rows = by_kind({plan.index: plan.faults}, s.job, faults, recoveries)
    name = label(plan.faults[0], s.job)
    first = rows[name]
    timed = [1.0] + ([2.0] if label(plan.faults[inside], s.job) == name else [])
    assert first["mttr_p50_s"] == statistics.median(timed) and first["detect_p50_s"] == 0.5
    assert sum(r["applied"] + r["skipped"] for n, r in rows.items() if n != DURING_RECOVERY) == len(
        plan.faults
    )
    assert sum(r["skipped"] for n, r in rows.items() if n != DURING_RECOVERY) == 1
    inside_row = rows[DURING_RECOVERY]
    assert inside_row["recovered"] == 1 and inside_row["mttr_p50_s"] == 2.0
    assert sum(r["recovered"] for n, r in rows.items() if n != DURING_RECOVERY) == 2


def test_a_fault_absorbed_by_another_recovery_is_timed_by_it_without_a_detection() -> None:
    s = load_scenario(CAMPAIGN)
    plan = expand(s)[0]
    names = [label(f, s.job) for f in plan.faults]
    other = next(i for i, name in enumerate(names) if name != names[0])
    faults = [{"run": plan.index, "index": i, "t": 10.0 + i} for i in range(len(plan.faults))]
    recoveries = [
        {
            "run": plan.index,
            "epoch": 2,
            "fault": 0,
            "mttr_from_fault_s": 1.0,
            "detect_from_fault_s": 0.25,
            "absorbed": [{"fault": other, "mttr_from_fault_s": 0.75}],
        }
    ]
    rows = by_kind({plan.index: plan.faults}, s.job, faults, recoveries)
    assert sum(r["recovered"] for n, r in rows.items() if n != DURING_RECOVERY) == 2
    absorbed = rows[names[other]]
    assert absorbed["recovered"] == 1 and absorbed["mttr_p50_s"] == 0.75
    assert absorbed["detect_p50_s"] is None  # it was not detected on its own
    assert rows[names[0]]["detect_p50_s"] == 0.25


def test_unexplained_recoveries_are_failures_no_fault_and_no_plan_explains() -> None:
    recoveries = [
        {"run": 0, "epoch": 1, "fault": 0, "cause": "kill-node", "reason": "lost n1"},
        {"run": 0, "epoch": 2, "cause": "rejoin", "reason": "admit n1/0"},
        {"run": 0, "epoch": 3, "cause": "drain", "reason": "drain n2"},
        # Sharded state an earlier fault left missing: the epoch admitting its holder.
        {"run": 0, "epoch": 4, "cause": "missing-state", "reason": "admit n0/0 for the ..."},
        {"run": 1, "epoch": 4, "cause": "heartbeat-missed", "reason": "n3 silent 0.5 s"},
        {"run": 1, "epoch": 5, "cause": "worker-exit", "reason": "n0/0 exited 1"},
    ]
    assert unexplained(recoveries) == [
        {"run": 1, "epoch": 4, "cause": "heartbeat-missed", "reason": "n3 silent 0.5 s"},
        {"run": 1, "epoch": 5, "cause": "worker-exit", "reason": "n0/0 exited 1"},
    ]
