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
