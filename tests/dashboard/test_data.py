"""The dashboard's data: series and recoveries from events, for finished and live runs,
and a reader that follows run directories while they are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent.protocol.events import EventKind
from keepstep.dashboard.data import RunInputs, build_view
from keepstep.dashboard.reader import RunReader, find_runs
from keepstep.launch.summary import build_summary

T = 1_800_000_000.0
GB = 24


def commit(t: float, epoch: int, step: int, world: int, member: str = "n0/0") -> dict[str, Any]:
    members = [f"n{i}/0" for i in range(world)]
    per = 6 // world
    assignment = {m: list(range(i * per, (i + 1) * per)) for i, m in enumerate(members)}
    mine = assignment.get(member, [])
    return {
        "t": T + t, "kind": "commit", "member": member, "step": step, "epoch": epoch,
        "world_size": world, "micro_batches": mine, "samples": list(range(4 * len(mine))),
        "step_s": 0.02, "assignment": assignment,
    }  # fmt: skip


FAULTS = [{"kind": "kill-node", "node": "n1", "step": 5, "spec": "kill-node:1@step=5",
           "t": T + 1.65}]  # fmt: skip


def run_events() -> list[dict[str, Any]]:
    """3 nodes; n1 dies after step 4; step 5 (committed by n0 alone) is redone at world 2."""
    ev: list[dict[str, Any]] = [
        {"t": T + 0.01 * i, "kind": "agent-started", "node": f"n{i}", "pid": i} for i in range(3)
    ]
    ev.append({"t": T + 1.0, "kind": "epoch-agreed", "epoch": 0,
               "members": ["n0/0", "n1/0", "n2/0"], "reason": "all nodes ready"})  # fmt: skip
    for s in range(5):
        ev += [commit(1.1 + 0.1 * s + 0.001 * i, 0, s, 3, f"n{i}/0") for i in range(3)]
    ev.append(commit(1.6, 0, 5, 3))
    ev += [
        {"t": T + 1.7, "kind": "fault-detected", "cause": "collective", "node": "n0",
         "epoch": 0, "reason": "allreduce failed"},
        {"t": T + 1.8, "kind": "epoch-agreed", "epoch": 1, "members": ["n0/0", "n2/0"],
         "reason": "lost n1/0", "planned": False, "step": 5, "agree_s": 0.1},
        {"t": T + 1.85, "kind": "reconfigured", "member": "n0/0", "epoch": 1,
         "members": ["n0/0", "n2/0"], "communicator_s": 0.02, "restore_s": 0.01,
         "replan_s": 0.001, "resume_step": 5, "rolled_back_steps": 1, "received_state": False},
    ]  # fmt: skip
    ev += [commit(1.9 + 0.1 * (s - 5), 1, s, 2) for s in range(5, 10)]
    return ev


def finished_inputs() -> RunInputs:
    events = run_events()
    summary = build_summary(events, FAULTS, steps=10, global_batch=GB, micro_batch=4)
    return RunInputs("demo", events, FAULTS, summary, steps_total=10)


def test_finished_run_view() -> None:
    view = build_view(finished_inputs(), now=T + 1000)
    assert view["status"] == "finished"
    assert view["t0"] == T + 1.0 and view["startup_s"] == pytest.approx(1.0)
    assert (view["step"], view["steps_total"], view["world_size"]) == (10, 10, 2)
    # One point per (epoch, step): step 5 appears twice, first at world 3, then redone at 2.
    assert view["world"]["size"] == [3] * 6 + [2] * 5
    assert view["world"]["step"] == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9]
    assert view["world"]["t"][0] == pytest.approx(0.1)
    # Throughput: 24 samples per 0.1 s, with a break (None) where the recovery lies.
    rates = view["throughput"]["samples_per_s"]
    assert rates.index(None) == 5 and len(rates) == 10
    assert [r for r in rates if r is not None] == pytest.approx([240.0] * 9, rel=0.02)
    (r,) = view["recoveries"]
    assert (r["cause"], r["node"], r["epoch"], r["step"]) == ("kill-node", "n1", 1, 5)
    assert r["start"] == pytest.approx(0.65) and r["end"] == pytest.approx(0.9)
    assert r["mttr_s"] == pytest.approx(0.25)
    assert r["phases"] == pytest.approx(
        {"detect": 0.05, "agree": 0.1, "communicator": 0.02, "restore": 0.01,
         "replan": 0.001, "first-step": 0.069}, abs=1e-6
    )  # fmt: skip
    assert sum(r["phases"].values()) == pytest.approx(r["mttr_s"])
    assert r["rolled_back_steps"] == 1
    assert view["faults"] == [
        {"kind": "kill-node", "node": "n1", "step": 5, "spec": "kill-node:1@step=5",
         "t": pytest.approx(0.65)}
    ]  # fmt: skip
    g = view["goodput"]
    assert g["window_s"] == pytest.approx(1.3)
    assert g["recovery_s"] == pytest.approx(0.25)
    assert (g["rolled_back_s"], g["rolled_back_commits"]) == (pytest.approx(0.02), 1)
    assert g["useful_samples"] == 10 * GB
    assert g["fraction"] == pytest.approx((1.3 - 0.25 - 0.02) / 1.3)
    assert view["mttr_p50_s"] == pytest.approx(0.25)
    json.dumps(view)  # what the server sends


def with_loss(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's commits with a logged loss: 1/(step+1), and 9.0 for the rolled-back step 5."""
    out = []
    for e in events:
        if e["kind"] == EventKind.COMMIT:
            loss = 9.0 if (e["epoch"], e["step"]) == (0, 5) else 1 / (e["step"] + 1)
            e = {**e, "metrics": {"loss": loss}, "skipped": False}
        out.append(e)
    return out


def test_loss_curve_is_the_standing_commits_one_point_per_step() -> None:
    events = with_loss(run_events())
    summary = build_summary(events, FAULTS, steps=10, global_batch=GB, micro_batch=4)
    finished = build_view(RunInputs("demo", events, FAULTS, summary, 10), now=T + 1000)
    loss = finished["metrics"]["loss"]
    assert loss["step"] == list(range(10))
    assert loss["value"] == pytest.approx([1 / (s + 1) for s in range(10)])
    assert loss["value"] == summary["metrics"]["loss"]  # the redo of step 5, not its 9.0
    # Live, before step 5 was redone: its commit in epoch 0 is the one that stands so far.
    live = [e for e in events if not (e["kind"] == EventKind.COMMIT and e["epoch"] == 1)]
    loss = build_view(RunInputs("demo", live), now=T + 2)["metrics"]["loss"]
    assert loss["step"] == [0, 1, 2, 3, 4, 5] and loss["value"][-1] == 9.0


def test_loss_curve_gaps_and_runs_that_logged_nothing() -> None:
    assert build_view(finished_inputs(), now=T)["metrics"] == {}
    events = with_loss(run_events())
    for e in events:
        if e["kind"] == EventKind.COMMIT and e["step"] == 2:
            e["metrics"] = {"loss": float("nan")}
        if e["kind"] == EventKind.COMMIT and e["step"] == 3:
            e["metrics"] = {}
    view = build_view(RunInputs("demo", events), now=T + 3)
    loss = view["metrics"]["loss"]
    assert loss["step"] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert loss["value"][2] is None  # NaN: a gap, and JSON a browser parses
    json.loads(json.dumps(view), parse_constant=lambda c: pytest.fail(f"{c} in the view"))


def test_live_run_view_has_recoveries_before_the_summary() -> None:
    events = run_events()
    view = build_view(RunInputs("demo", events), now=T + 3)
    assert view["status"] == "live"
    (r,) = view["recoveries"]
    # No fault log yet: the recovery starts at its detection.
    assert (r["cause"], r["node"]) == ("collective", "n0")
    assert r["start"] == pytest.approx(0.7) and r["mttr_s"] == pytest.approx(0.2)
    assert view["mttr_p50_s"] == pytest.approx(0.2)
    assert build_view(RunInputs("demo", events), now=T + 500)["status"] == "stopped"


def test_recovery_still_in_progress() -> None:
    events = [e for e in run_events() if not (e["kind"] == EventKind.COMMIT and e["epoch"] == 1)]
    (r,) = build_view(RunInputs("demo", events), now=T + 2)["recoveries"]
    assert r["mttr_s"] is None and r["end"] is None
    assert r["phases"]["first-step"] == 0.0


def test_empty_and_starting_runs() -> None:
    view = build_view(RunInputs("new", []), now=T)
    assert view["status"] == "starting"
    assert view["recoveries"] == [] and view["world"]["size"] == []
    assert view["goodput"]["fraction"] is None
    started = build_view(RunInputs("new", run_events()[:3]), now=T + 1)
    assert (started["status"], started["step"]) == ("live", 0)


def write_lines(path: Path, events: list[dict[str, Any]], tail: str = "") -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events) + tail)


def test_reader_follows_growing_files(tmp_path: Path) -> None:
    run = tmp_path / "run-a"
    run.mkdir()
    events = run_events()
    n0 = [e for e in events if e.get("member", e.get("node", "n0")).startswith("n0")]
    others = [e for e in events if e not in n0]
    reader = RunReader(run)
    assert reader.poll().events == ()
    half = json.dumps(n0[5])
    write_lines(run / "events-n0.jsonl", n0[:5], tail=half[:20])  # a line still being written
    first = reader.poll()
    assert first.events == tuple(n0[:5]) and first.summary is None
    with (run / "events-n0.jsonl").open("a") as f:
        f.write(half[20:] + "\n")
    write_lines(run / "events-n0.jsonl", n0[6:])
    write_lines(run / "events-n1.jsonl", others)  # a node's file that appears late
    (run / "agent-n0.json").write_text(json.dumps({"steps": 10}))
    second = reader.poll()
    assert list(second.events) == sorted(events, key=lambda e: e["t"])
    assert second.steps_total == 10
    (run / "faults.json").write_text(json.dumps(FAULTS))
    (run / "summary.json").write_text(json.dumps(finished_inputs().summary))
    done = reader.poll()
    assert done.faults == tuple(FAULTS)
    assert build_view(done, now=T)["status"] == "finished"


def test_a_run_whose_members_disagree_is_failed_not_finished() -> None:
    done = finished_inputs()
    assert build_view(done, now=T)["failures"] == []
    disagree = {**done.summary, "params_sha256": None, "failures": ["the workers finished "
                "with 2 different parameter digests"]}  # fmt: skip
    view = build_view(RunInputs("demo", done.events, FAULTS, disagree, 10), now=T)
    assert view["status"] == "failed"
    assert view["failures"] == ["the workers finished with 2 different parameter digests"]
    # A summary from before the launcher wrote its verdict: disagreeing digests fail it.
    old = {k: v for k, v in disagree.items() if k != "failures"}
    old["params_sha256_disagree"] = ["ab" * 32, "cd" * 32]
    assert build_view(RunInputs("demo", done.events, FAULTS, old, 10), now=T)["status"] == "failed"


def test_reader_skips_a_damaged_line(tmp_path: Path) -> None:
    write_lines(tmp_path / "events-n0.jsonl", run_events()[:1], tail='{"t": 1, "ki\n')
    write_lines(tmp_path / "events-n0.jsonl", run_events()[1:2])
    assert len(RunReader(tmp_path).poll().events) == 2


def test_find_runs(tmp_path: Path) -> None:
    for name in ("run-b", "run-a"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events-n0.jsonl").write_text("")
    (tmp_path / "not-a-run").mkdir()
    assert list(find_runs(tmp_path)) == ["run-a", "run-b"]
    assert find_runs(tmp_path / "run-a") == {"run-a": tmp_path / "run-a"}
    assert find_runs(tmp_path / "missing") == {}
