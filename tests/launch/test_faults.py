"""Fault specs: every accepted form, and a clear error for each bad one."""

from __future__ import annotations

import pytest

from keepstep.elastic.errors import ConfigError
from keepstep.launch.faults import FaultKind, FaultSpec, check_faults, parse_fault


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("kill-worker:1@step=5", FaultSpec(FaultKind.KILL_WORKER, 1, 5)),
        ("kill-node:0@step=12", FaultSpec(FaultKind.KILL_NODE, 0, 12)),
        ("hang-node:3@step=7", FaultSpec(FaultKind.HANG_NODE, 3, 7)),
        ("drain-node:2@step=9", FaultSpec(FaultKind.DRAIN_NODE, 2, 9)),
        ("join-node@step=4", FaultSpec(FaultKind.JOIN_NODE, None, 4)),
        (
            "slow-node:1@step=5:factor=3,duration=10",
            FaultSpec(FaultKind.SLOW_NODE, 1, 5, factor=3.0, duration=10.0),
        ),
        ("slow-node:2@step=1:factor=2.5", FaultSpec(FaultKind.SLOW_NODE, 2, 1, factor=2.5)),
        (
            "slow-node:0@step=3:factor=20,duration=0.5,method=signal",
            FaultSpec(FaultKind.SLOW_NODE, 0, 3, factor=20.0, duration=0.5, method="signal"),
        ),
    ],
)
def test_accepted(text: str, spec: FaultSpec) -> None:
    assert parse_fault(text) == spec
    assert str(spec) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kill-nod:1@step=5", "unknown kind 'kill-nod'"),
        ("kill-node@step=5", "kill-node needs a node"),
        ("join-node:2@step=5", "join-node takes no node"),
        ("kill-node:1@5", "is not of the form"),
        ("kill-node:1@step=-1", "is not of the form"),
        ("slow-node:1@step=5", "slow-node needs a factor"),
        ("slow-node@step=5:factor=3", "slow-node needs a node"),
        ("slow-node:1@step=5:factor=1", r"factor 1.0 must be a number in \(1, 20\]"),
        ("slow-node:1@step=5:factor=21", r"factor 21.0 must be a number in \(1, 20\]"),
        ("slow-node:1@step=5:factor=nan", r"factor nan must be a number in \(1, 20\]"),
        ("slow-node:1@step=5:factor=three", "factor 'three' is not a number"),
        ("slow-node:1@step=5:factor=3,duration=0", "duration 0.0 must be a number of seconds"),
        ("slow-node:1@step=5:factor=3,duration=-2", "duration -2.0 must be a number of seconds"),
        ("slow-node:1@step=5:factor=3,method=freezer", "method 'freezer'; allowed: auto, cgr"),
        ("slow-node:1@step=5:factor=3,speed=2", "unknown option 'speed'; allowed: factor"),
        ("slow-node:1@step=5:factor=3,factor=4", "option 'factor' is given twice"),
        ("slow-node:1@step=5:factor", "option 'factor' is not NAME=VALUE"),
        ("slow-node:1@step=5:", "option '' is not NAME=VALUE"),
        ("kill-node:1@step=5:factor=3", "kill-node takes no options \\(got factor\\)"),
        ("drain-node:1@step=5:method=signal", "drain-node takes no options \\(got method\\)"),
    ],
)
def test_rejected(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_fault(text)


def test_faults_must_name_existing_nodes_and_happen_in_time() -> None:
    with pytest.raises(ConfigError, match=r"node 4 does not exist \(nodes are 0..3\)"):
        check_faults([parse_fault("kill-node:4@step=3")], nodes=4, steps=10)
    check_faults([parse_fault("join-node@step=2"), parse_fault("kill-node:4@step=3")], 4, 10)
    with pytest.raises(ConfigError, match="not before --steps 10"):
        check_faults([parse_fault("kill-node:1@step=10")], nodes=4, steps=10)


def test_a_bad_value_names_the_whole_spec() -> None:
    with pytest.raises(ConfigError, match=r"^fault 'slow-node:1@step=5:factor=0.5': "):
        parse_fault("slow-node:1@step=5:factor=0.5")


def test_a_slowed_node_keeps_a_share_and_stays_a_member() -> None:
    slow = parse_fault("slow-node:1@step=5:factor=4")
    assert slow.share == 0.25 and slow.duration is None and slow.method == "auto"
    assert not slow.kind.changes_membership
    assert all(k.changes_membership for k in FaultKind if k is not FaultKind.SLOW_NODE)
    assert parse_fault("kill-node:1@step=5").share == 1.0


def test_a_spec_made_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="slow-node factor 0 must be"):
        FaultSpec(FaultKind.SLOW_NODE, 1, 5, factor=0)
    with pytest.raises(ConfigError, match="join-node takes no options"):
        FaultSpec(FaultKind.JOIN_NODE, None, 5, duration=3.0)


def test_a_slowed_node_must_exist() -> None:
    with pytest.raises(ConfigError, match="node 4 does not exist"):
        check_faults([parse_fault("slow-node:4@step=3:factor=3")], nodes=4, steps=10)
