"""The scale bench's simulated agents on a real etcd: a lost node, one agreed epoch.

Twenty agents run the agent's membership code (`bench/agreement_scale.py`) in this process;
one node crashes (its lease revoked, its probe port closed) and every survivor must enter
the same next epoch, which leaves the lost node out. The bench's own `check` is what
fails when one agent is missing, disagrees or still names the lost node.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keepstep.launch.etcd_server import EtcdServer

BENCH = Path(__file__).resolve().parents[3] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import agreement_scale  # noqa: E402


@pytest.mark.timeout(60)
@pytest.mark.parametrize("clients", ["agent", "shared"])
def test_twenty_agents_agree_one_epoch_without_the_lost_node(
    etcd_binary: str, tmp_path: Path, clients: str
) -> None:
    # "shared": one watched view for the process; its deliveries count once per agent.
    args = agreement_scale.parse_args(
        ["--sizes", "20", "--losses", "2", "--procs", "0", "--lease-ttl", "5", "--clients", clients]
    )
    with EtcdServer.start(etcd_binary, tmp_path / "etcd") as etcd:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        result = agreement_scale.run_size(etcd, 20, args, run_dir)
    assert result["agents"] == 20 and result["deciders"] == 20
    assert [loss["deletes"] for loss in result["losses"]] == [1.0, 1.0]  # the lost record
    assert [loss["puts"] for loss in result["losses"]] == [1.0, 1.0]  # one epoch won
    # Each survivor saw the record deleted and the new epoch: two events each.
    assert [loss["events_received"] for loss in result["losses"]] == [38, 36]
    assert 0 < result["p50_s"] <= result["max_s"] < 20


def test_the_check_refuses_disagreement_and_a_lost_member() -> None:
    def reply(digests: dict[str, str], lost_in: list[str]) -> dict[str, object]:
        return {"digests": digests, "entered": dict.fromkeys(digests, 1.0), "lost_in": lost_in}

    assert agreement_scale.check([reply({"n1": "a", "n2": "a"}, [])], 2, ["n0"]) == [1.0, 1.0]
    with pytest.raises(AssertionError, match="disagree"):
        agreement_scale.check([reply({"n1": "a", "n2": "b"}, [])], 2, ["n0"])
    with pytest.raises(AssertionError, match="lost node"):
        agreement_scale.check([reply({"n1": "a"}, ["n1"])], 1, ["n0"])
    with pytest.raises(AssertionError, match="1 agents answered, 2 expected"):
        agreement_scale.check([reply({"n1": "a"}, [])], 2, ["n0"])
