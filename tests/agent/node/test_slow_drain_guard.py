"""The agent's guard on slow drains (keepstep.agent.node.slow_drain.admit)."""

from __future__ import annotations

from keepstep.agent.node.slow_drain import admit
from keepstep.agent.protocol import EpochRecord

EPOCH = EpochRecord(3, ["n0/0", "n0/1", "n1/0", "n1/1", "n2/0", "n2/1"], "test", 10, 0.0)


def test_a_slow_member_drains_its_whole_node_when_enough_stay() -> None:
    ok, why = admit("n1", "n1/1", EPOCH, (), min_nodes=2, draining=False)
    assert ok and "2 node(s) stay" in why


def test_never_below_min_nodes_counting_nodes_already_leaving() -> None:
    ok, why = admit("n1", "n1/0", EPOCH, {"n2"}, min_nodes=2, draining=False)
    assert not ok and "needs at least 2" in why
    ok, why = admit("n1", "n1/0", EPOCH, (), min_nodes=3, draining=False)
    assert not ok and "would leave 2 node(s)" in why


def test_never_the_last_node_and_never_twice() -> None:
    alone = EpochRecord(5, ["n1/0"], "test", 10, 0.0)
    ok, why = admit("n1", "n1/0", alone, (), min_nodes=1, draining=False)
    assert not ok and "needs at least 1" in why
    ok, why = admit("n1", "n1/0", EPOCH, (), min_nodes=1, draining=True)
    assert not ok and "draining already" in why


def test_only_a_member_of_the_current_epoch_on_this_node() -> None:
    assert not admit("n1", "n4/0", EPOCH, (), 1, False)[0]
    assert not admit("n1", "n2/0", EPOCH, (), 1, False)[0]
    assert not admit("n1", "n1/0", None, (), 1, False)[0]
