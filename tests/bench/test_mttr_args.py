"""bench/mttr.py's job flags and bench/mttr_matrix.py's pure parts; nothing is run."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import mttr
import mttr_matrix

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> mttr.Settings:
    parser = argparse.ArgumentParser()
    mttr.add_job_args(parser)
    mttr.add_settings_args(parser)
    return mttr.settings_from(parser.parse_args(list(argv)))


def test_no_flags_keep_the_default_job() -> None:
    s = parse()
    assert s == mttr.Settings()
    assert (s.nodes, s.script_args) == (4, ())
    assert s.script_argv() == [str(REPO / "examples" / "mlp.py"), "--sleep", "0.01"]
    assert s.script_argv(sleep=0.0)[-1] == "0.0"  # the fault-free run


def test_settings_without_job_flags_keep_the_default_job() -> None:
    # bench/torchrun_baseline.py's parser has add_settings_args only.
    parser = argparse.ArgumentParser()
    mttr.add_settings_args(parser)
    assert mttr.settings_from(parser.parse_args([])) == mttr.Settings()


def test_another_script_gets_its_args_and_no_sleep() -> None:
    flags = "--layers 2 --seq 32"
    s = parse("--nodes", "2", "--script", "examples/transformer.py", "--script-args", flags)
    assert s.nodes == 2
    assert s.script_argv() == [str(REPO / "examples" / "transformer.py"), *flags.split()]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nodes", "1"], "argument --nodes: 1: nodes must be >= 2"),
        (["--nodes", "two"], "argument --nodes: 'two' is not a whole number"),
        (["--script", "no/such.py"], "argument --script: 'no/such.py': no such file"),
    ],
)
def test_bad_job_flags_name_the_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_settings_refuse_one_node() -> None:
    with pytest.raises(ValueError, match="--nodes 1 must be >= 2"):
        mttr.Settings(nodes=1)


def test_two_nodes_schedule_hits_live_nodes() -> None:
    s = mttr.Settings(nodes=2)
    assert mttr.fault_schedule("kill-node", 2, s) == [
        "kill-node:1@step=10",
        "join-node@step=10",
        "kill-node:2@step=65",  # n2 joined at step 10
        "join-node@step=65",
    ]
    assert mttr.fault_schedule("kill-worker", 3, s) == [
        "kill-worker:1@step=10",
        "kill-worker:0@step=35",
        "kill-worker:1@step=60",
    ]


def test_matrix_lists() -> None:
    assert mttr_matrix.node_list("2,4,8") == [2, 4, 8]
    assert mttr_matrix.shard_list("none, zero2") == ["none", "zero2"]
    with pytest.raises(argparse.ArgumentTypeError, match="nodes must be >= 2"):
        mttr_matrix.node_list("2,1")
    with pytest.raises(argparse.ArgumentTypeError, match="zero3"):
        mttr_matrix.shard_list("zero1,zero3")


def test_matrix_join_after_reaches_every_cell_and_is_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.argv", ["mttr_matrix.py", "--join-after", "15"])
    _, base = mttr_matrix.parse_args()
    assert base.join_after == 15
    monkeypatch.setattr("sys.argv", ["mttr_matrix.py"])
    assert mttr_matrix.parse_args()[1].join_after == 0
    monkeypatch.setattr("sys.argv", ["mttr_matrix.py", "--join-after", "60"])
    with pytest.raises(SystemExit):
        mttr_matrix.parse_args()
    assert "--join-after 60 must be >= 0 and below --node-spacing" in capsys.readouterr().err


def report(runs: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    kind = {"count": len(records), "mttr_p50_s": 1.0, "mttr_p95_s": 2.0}
    return {"kinds": {"kill-node": {**kind, "runs": runs, "records": records}}}


def test_matrix_row_figures() -> None:
    records = [{"reshard_bytes": b, "reshard_s": 0.1} for b in (0, 100, 300)]
    runs: list[dict[str, Any]] = [
        {"params_sha256": "a", "params_match": True, "extra_epochs": [{}]},
        {"params_sha256": None, "params_match": False, "extra_epochs": []},  # unfinished
    ]
    r = report(runs, records)
    row = mttr_matrix.kind_row(r, "kill-node")
    assert (row["count"], row["reshard_bytes_p50"]) == (3, 100.0)
    assert mttr_matrix.kind_row(r, "kill-worker")["mttr_p50_s"] is None
    assert mttr_matrix.params_verdict(r) == "equal"
    assert mttr_matrix.extra_epochs(r) == 1
    runs[0]["params_match"] = False
    assert mttr_matrix.params_verdict(r) == "DIFFER"
    assert mttr_matrix.params_verdict(report([], records)) == "-"


def test_two_node_cells_leave_time_for_the_replacement() -> None:
    # On 2 nodes each fault would otherwise hit the lone survivor of the one before, whose
    # recovery is a cold start: worker kills get room, and a lost node's joiner comes at once.
    base = mttr.Settings(join_after=15, worker_spacing=25)
    two = mttr_matrix.cell_settings(mttr_matrix.Cell("zero1", 2), base)
    assert (two.nodes, two.shard, two.join_after, two.worker_spacing) == (2, "zero1", 0, 60)
    four = mttr_matrix.cell_settings(mttr_matrix.Cell("none", 4), base)
    assert (four.nodes, four.shard, four.join_after, four.worker_spacing) == (4, None, 15, 25)
    wide = mttr_matrix.cell_settings(mttr_matrix.Cell("none", 2), replace(base, worker_spacing=90))
    assert wide.worker_spacing == 90
