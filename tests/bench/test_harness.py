"""The benchmark harness's pure parts: schedule, ledger, figures, configuration."""

from __future__ import annotations

from typing import Any

import pytest

from harness import figures
from harness.assemble import step_time_ratio_by_round
from harness.bench import plan_runs
from harness.config import QUICK, BenchConfig, System, Workload, with_overrides
from harness.ledger import build_ledger
from harness.runs import Done, Planned, RunResult
from harness.schedule import FaultKind, make_schedule
from keepstep.launch.faults import parse_fault

# -- schedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("steps", [24, 36, 80])
def test_schedule_is_seeded_and_keeps_every_window(seed: int, steps: int) -> None:
    faults = make_schedule(seed, steps, nodes=4, warmup=3)
    assert faults == make_schedule(seed, steps, nodes=4, warmup=3)
    kill, worker, join = faults
    assert [f.kind for f in faults] == [
        FaultKind.KILL_NODE,
        FaultKind.KILL_WORKER,
        FaultKind.JOIN_NODE,
    ]
    # Never node 0; the worker crash hits a node that survived the kill.
    assert kill.node in (1, 2, 3) and worker.node in (1, 2, 3) and worker.node != kill.node
    assert kill.step >= 2 * 3 + 2  # a steady window after the warm-up
    assert worker.step >= kill.step + 3 + 3  # a three-node stretch
    assert join.step >= worker.step + 5 and join.step <= steps - 5  # and a tail
    for f in faults:  # keepstep's own parser takes the same specs
        parsed = parse_fault(f.spec())
        assert (parsed.kind.value, parsed.node, parsed.step) == (f.kind.value, f.node, f.step)


def test_schedule_depends_on_the_seed() -> None:
    assert len({make_schedule(seed, 80, 4, 3) for seed in range(10)}) > 1


def test_schedule_refuses_too_few_steps() -> None:
    with pytest.raises(ValueError, match="steps=20"):
        make_schedule(0, 20, nodes=4, warmup=3)


# -- ledger ------------------------------------------------------------------------------


def work(
    gen: Any, step: int, member: str, mbs: list[int], t: float, key: int | None = None
) -> dict[str, Any]:
    return {
        "kind": "work", "gen": gen, "step": step, "key_step": step if key is None else key,
        "member": member, "mbs": mbs, "loss_sum": float(len(mbs)), "t0": t - 0.5, "t": t,
    }  # fmt: skip


def commit(gen: Any, step: int, member: str, who: list[str] | None, t: float) -> dict[str, Any]:
    return {
        "kind": "commit", "gen": gen, "step": step, "member": member, "contributors": who,
        "world": 2, "t0": t - 1.0, "t": t,
    }  # fmt: skip


def test_a_redone_step_counts_once_from_its_newest_commit() -> None:
    # All-or-nothing reduction (DDP): rank 0's commit line stands for every rank's work.
    records = [
        work(1.0, 0, "a", [0], 1.0), work(1.0, 0, "b", [1], 1.0), commit(1.0, 0, "a", None, 1.1),
        work(1.0, 1, "a", [0], 2.0), work(1.0, 1, "b", [1], 2.0), commit(1.0, 1, "a", None, 2.1),
        # a restart from the step-0 checkpoint: step 1 is computed and committed again
        work(9.0, 1, "a", [0], 5.0), work(9.0, 1, "b", [1], 5.0), commit(9.0, 1, "a", None, 5.1),
    ]  # fmt: skip
    led = build_ledger(records, steps=2, n_micro=2, micro_batch=3)
    assert [e.gen for e in led.entries] == [1.0, 9.0]
    assert (led.expected, led.seen_once, led.lost, led.duplicated) == (12, 12, 0, 0)
    assert [e.samples for e in led.entries] == [6, 6]


def test_work_without_a_commit_in_its_generation_is_not_trained() -> None:
    records = [
        work(1, 0, "a", [0], 1.0), work(1, 0, "b", [1], 1.0),  # step 0 failed in gen 1
        work(2, 0, "a", [0, 1], 3.0), commit(2, 0, "a", ["a"], 3.1),  # redone alone
    ]  # fmt: skip
    led = build_ledger(records, steps=1, n_micro=2, micro_batch=1)
    assert (led.seen_once, led.lost, led.duplicated) == (2, 0, 0)
    assert led.entries[0].world == 1


def test_a_missing_replica_loses_its_shard_and_a_reread_shard_is_duplicated() -> None:
    records = [
        work(1, 0, "r0", [0], 1.0), commit(1, 0, "r0", ["r0"], 1.1),
        work(1, 0, "r1", [1], 1.0), commit(1, 0, "r1", ["r1"], 1.1),
        # step 1: replica r1 is down, its micro-batch 1 is never trained
        work(2, 1, "r0", [0], 2.0), commit(2, 1, "r0", ["r0"], 2.1),
        # step 2: r1 is back with a fresh data position (data step 0 again)
        work(3, 2, "r0", [0], 3.0), commit(3, 2, "r0", ["r0"], 3.1),
        work(3, 2, "r1", [1], 3.0, key=0), commit(3, 2, "r1", ["r1"], 3.1),
    ]  # fmt: skip
    led = build_ledger(records, steps=3, n_micro=2, micro_batch=4)
    assert led.lost == 2 * 4  # (1, 1) and (2, 1)
    assert led.duplicated == 4  # (0, 1) twice
    assert [e.samples for e in led.entries] == [8, 4, 8]
    assert led.entries[2].once_samples == 4


def test_a_recovering_replica_that_does_not_take_part_contributes_nothing() -> None:
    records = [
        work(1, 0, "r0", [0], 1.0), commit(1, 0, "r0", ["r0"], 1.1),
        work(1, 0, "r1", [1], 1.0), commit(1, 0, "r1", [], 1.1),
    ]  # fmt: skip
    led = build_ledger(records, steps=1, n_micro=2, micro_batch=1)
    assert (led.lost, led.entries[0].world) == (1, 1)


def test_a_member_killed_after_the_reduction_still_contributed() -> None:
    # keepstep: "c" computed, the reduction completed, "c" was killed before its commit
    # line; the others committed, so c's micro-batch is in the update.
    records = [
        work(0, 0, "a", [0], 1.0), work(0, 0, "b", [1], 1.0), work(0, 0, "c", [2], 1.0),
        commit(0, 0, "a", ["a"], 1.2), commit(0, 0, "b", ["b"], 1.2),
    ]  # fmt: skip
    led = build_ledger(records, steps=1, n_micro=3, micro_batch=2)
    assert (led.seen_once, led.lost, led.entries[0].world) == (6, 0, 3)


def test_a_work_line_can_say_it_did_not_take_part() -> None:
    records = [
        work(1, 0, "r0", [0], 1.0),
        {**work(1, 0, "r1", [1], 1.0), "participating": False},
        commit(1, 0, "r0", ["r0"], 1.1),
    ]
    assert build_ledger(records, steps=1, n_micro=2, micro_batch=1).lost == 1


def test_lines_after_the_end_are_ignored() -> None:
    records = [
        work(1, 0, "a", [0, 1], 1.0), commit(1, 0, "a", ["a"], 1.1),
        work(7, 0, "late", [0, 1], 9.0), commit(7, 0, "late", ["late"], 9.1),
    ]  # fmt: skip
    assert build_ledger(records, 1, 2, 1, end_t=5.0).entries[0].gen == 1
    assert build_ledger(records, 1, 2, 1).entries[0].gen == 7


# -- figures -----------------------------------------------------------------------------


def steady_then_three(t_kill: float) -> list[dict[str, Any]]:
    """4 members, 1 s per step, until `t_kill`; then 3 members, 4/3 s per step."""
    records, t, step = [], 0.0, 0
    members = ["a", "b", "c", "d"]
    while step < 20:
        t += 1.0 if t < t_kill else 4 / 3
        if len(members) == 4 and t > t_kill:
            members = ["a", "b", "c"]
            t += 2.0  # the recovery
        mbs = {m: [i for i in range(12) if i % len(members) == k] for k, m in enumerate(members)}
        for m in members:
            records.append(work(1 if len(members) == 4 else 2, step, m, mbs[m], t - 0.1))
            records.append(commit(1 if len(members) == 4 else 2, step, m, [m], t))
        step += 1
    return records


def test_mttr_and_throughput_after_losing_a_node() -> None:
    led = build_ledger(steady_then_three(8.5), steps=20, n_micro=12, micro_batch=4)
    faults = [{"kind": "kill-node", "node": 3, "step": 8, "t": 8.5}]
    (outcome,) = figures.fault_outcomes(led, faults, full_world=4, steady_s=1.0)
    # first attempt started after 8.5 s: step 8 (started at 9 + 2 + 4/3 - 1)
    first = next(e for e in led.entries if e.t_start > 8.5)
    assert outcome["mttr_s"] == pytest.approx(first.t_commit - 8.5)
    tal = figures.throughput_after_loss(led, faults, warmup=2, full_world=4)
    assert tal["before_samples_per_s"] == pytest.approx(48.0)
    assert tal["after_samples_per_s"] == pytest.approx(36.0)
    assert tal["fraction"] == pytest.approx(0.75)
    assert figures.steady_intervals(led, 2, 4) == pytest.approx([1.0] * 6)


def test_goodput_counts_samples_trained_once_per_second() -> None:
    led = build_ledger(steady_then_three(100.0), steps=20, n_micro=12, micro_batch=4)
    assert figures.goodput(led) == pytest.approx(48.0)


def test_the_step_time_ratio_is_also_taken_within_each_round() -> None:
    cfg = with_overrides(QUICK, repeats=2, warmup_steps=2)

    def run(system: System, repeat: int, step_s: float, faulty: bool = False) -> Done:
        records = [
            {**r, "t": r["t"] * step_s, "t0": r["t0"] * step_s}
            for r in steady_then_three(t_kill=1000.0)
        ]
        led = build_ledger(records, steps=20, n_micro=12, micro_batch=4)
        return Done(Planned(system, faulty, repeat), RunResult(system, faulty), led)

    done = [
        run(System.DDP, 0, 1.0),
        run(System.KEEPSTEP, 0, 1.1),
        run(System.KEEPSTEP, 0, 1.1, faulty=True),  # no fault in it: all of it is steady
        run(System.KEEPSTEP, 1, 2.4),
        run(System.DDP, 1, 2.0),
    ]
    assert step_time_ratio_by_round(cfg, done) == pytest.approx([1.1, 1.2])
    assert step_time_ratio_by_round(cfg, done[:3]) == pytest.approx([1.1, None])


def test_ratios_say_which_way_they_go() -> None:
    ks = {"steady_step_s": 1.0, "samples_per_s": 48.0, "goodput_samples_per_s": 40.0,
          "faults": {"kill-node": {"mttr_p50_s": 0.5}},
          "throughput_after_loss": {"fraction": 0.75}}  # fmt: skip
    tr = {"steady_step_s": 1.25, "samples_per_s": 38.4, "goodput_samples_per_s": 20.0,
          "faults": {"kill-node": {"mttr_p50_s": 10.0}},
          "throughput_after_loss": {"fraction": 0.5}}  # fmt: skip
    ddp = {"steady_step_s": 1.0, "samples_per_s": 48.0, "faults": None}
    r = figures.ratios({"keepstep": ks, "torchrun": tr, "ddp": ddp})
    assert r["torchrun"]["mttr_p50_other_over_keepstep"] == {"kill-node": 20.0}
    assert r["torchrun"]["step_time_keepstep_over_other"] == pytest.approx(0.8)
    assert r["torchrun"]["goodput_keepstep_over_other"] == pytest.approx(2.0)
    assert r["ddp"]["mttr_p50_other_over_keepstep"] == {"kill-node": None}


# -- configuration -----------------------------------------------------------------------


def test_workload_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="global_batch=50 must be a positive multiple"):
        Workload(global_batch=50, micro_batch=4)
    with pytest.raises(ValueError, match="d_model=30 must be a multiple of heads=4"):
        Workload(d_model=30, heads=4)


def test_bench_config_needs_a_micro_batch_per_worker_and_the_reference() -> None:
    with pytest.raises(ValueError, match="need at least 5"):
        BenchConfig(Workload(global_batch=16, micro_batch=4))
    with pytest.raises(ValueError, match="must include ddp"):
        BenchConfig(Workload(), systems=(System.KEEPSTEP,))


def test_overrides_and_flags_round_trip() -> None:
    cfg = with_overrides(QUICK, steps=40, d_model=32, repeats=2)
    assert (cfg.workload.steps, cfg.workload.d_model, cfg.repeats) == (40, 32, 2)
    assert cfg.workload.heads == QUICK.workload.heads
    flags = cfg.workload.flags()
    assert flags[flags.index("--d-model") + 1] == "32"


def test_runs_are_interleaved_and_rotated() -> None:
    labels = [p.label for p in plan_runs(with_overrides(QUICK, repeats=2))]
    assert labels[:6] == [
        "ddp/fault-free #0",
        "keepstep/fault-free #0",
        "keepstep/faults #0",
        "torchrun/faults #0",
        "torchft/fault-free #0",
        "torchft/faults #0",
    ]
    assert labels[6:] == [
        "keepstep/faults #1",
        "keepstep/fault-free #1",
        "torchrun/faults #1",
        "torchft/faults #1",
        "torchft/fault-free #1",
        "ddp/fault-free #1",
    ]
