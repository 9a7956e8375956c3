"""bench/ray_train_mttr.py's pure parts: the kill schedule, MTTR and steps lost from a log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ray_train_mttr import RayTrainJob, recovery, steady_step_time, victim
from torchrun_baseline import read_log

WORLD = 4
T_KILL = 100.0


def ev(event: str, t: float, pid: int, rank: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "t": t, "pid": pid, "rank": rank, **fields}


def first_group(steps: int = 12) -> list[dict[str, Any]]:
    """Workers 10..13 (rank r = pid - 10), one committed step a second up to `steps`."""
    out = [ev("start", 1.0 + r / 10, 10 + r, r) for r in range(WORLD)]
    out += [ev("ready", 2.0 + r / 10, 10 + r, r, step=0) for r in range(WORLD)]
    out += [ev("step", 90.0 + s - steps, 10, 0, step=s) for s in range(1, steps + 1)]
    return out


def restarted_group(resumed: int, first_pid: int = 20, t0: float = 104.0) -> list[dict[str, Any]]:
    out = [ev("start", t0 + r / 10, first_pid + r, r) for r in range(WORLD)]
    out += [ev("ready", t0 + 1 + r / 10, first_pid + r, r, step=resumed) for r in range(WORLD)]
    out.append(ev("step", t0 + 2, first_pid, 0, step=resumed + 1))
    return out


def test_job_schedule_and_validation() -> None:
    job = RayTrainJob(96, 4, 0.01, faults=3, spacing=10, first_step=10, tail_steps=5)
    assert job.kill_steps == [10, 20, 30]
    assert job.steps == 45
    with pytest.raises(ValueError, match="--faults 0"):
        RayTrainJob(96, 4, 0.01, faults=0)
    with pytest.raises(ValueError, match="--ray-spacing 1"):
        RayTrainJob(96, 4, 0.01, spacing=1)
    with pytest.raises(ValueError, match="--health-check-interval 0"):
        RayTrainJob(96, 4, 0.01, health_check_interval=0)


def test_recovery_phases_add_up_to_mttr() -> None:
    events = first_group() + restarted_group(resumed=12)
    found = recovery(events, T_KILL, WORLD)
    assert found is not None
    assert found.restart_s == pytest.approx(104.3 - T_KILL)
    assert found.restore_s == pytest.approx(105.3 - 104.3)
    assert found.first_step_s == pytest.approx(106.0 - 105.3)
    assert found.mttr_s == pytest.approx(6.0)
    assert found.restart_s + found.restore_s + found.first_step_s == pytest.approx(found.mttr_s)
    assert (found.committed_at_kill, found.resumed_step, found.steps_lost) == (12, 12, 0)
    assert found.record()["steps_lost"] == 0


def test_a_checkpoint_the_controller_had_not_registered_is_a_lost_step() -> None:
    found = recovery(first_group() + restarted_group(resumed=10), T_KILL, WORLD)
    assert found is not None and found.steps_lost == 2


@pytest.mark.parametrize("cut", ["no step", "one worker not ready", "no restart"])
def test_no_recovery_until_every_new_worker_is_ready_and_a_step_committed(cut: str) -> None:
    after = restarted_group(resumed=12)
    if cut == "no step":
        after = [e for e in after if e["event"] != "step"]
    elif cut == "one worker not ready":
        after = [e for e in after if not (e["event"] == "ready" and e["rank"] == 3)]
    else:
        after = []
    assert recovery(first_group() + after, T_KILL, WORLD) is None


def test_events_of_survivors_after_the_kill_belong_to_the_old_group() -> None:
    # The old rank 0 logs a step just after the kill; a later restart is not this one's.
    late = ev("step", T_KILL + 0.01, 10, 0, step=13)
    events = [*first_group(), late, *restarted_group(12), *restarted_group(13, 30, 200.0)]
    found = recovery(events, T_KILL, WORLD)
    assert found is not None
    assert found.mttr_s == pytest.approx(6.0) and found.committed_at_kill == 12


def test_victim_is_the_newest_process_of_the_rank() -> None:
    events = first_group() + restarted_group(12)
    assert victim(events, 1) == 21
    assert victim(first_group(), 1) == 11
    assert victim([], 1) is None


def test_steady_step_time_skips_restarts() -> None:
    events = first_group() + restarted_group(12)
    events.append(ev("step", 106.5, 20, 0, step=15))  # not consecutive: no gap taken
    assert steady_step_time(events) == pytest.approx(1.0)
    assert steady_step_time(restarted_group(12)) is None


def test_the_log_reader_skips_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps(ev("start", 1.0, 10, 0)) + '\n{"event": "st')
    assert read_log(path) == [ev("start", 1.0, 10, 0)]
    assert read_log(tmp_path / "missing.jsonl") == []
