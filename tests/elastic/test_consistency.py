"""Bit-identity across rank counts and membership changes, with real processes on gloo.

The reference is the same seeded job trained by one process. Every other run (more ranks,
a drain, a join, a crash) must end with the same sha256 of the state dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

REPO = Path(__file__).resolve().parents[2]
JOBS: dict[str, dict[str, Any]] = {
    "mlp": {"script": str(REPO / "examples" / "mlp.py"), "global_batch": 48, "micro_batch": 4},
    "transformer": {
        "script": str(REPO / "examples" / "transformer.py"),
        "global_batch": 24,
        "micro_batch": 2,
    },
}
STEPS = 12

pytestmark = pytest.mark.slow


def members(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def launch(tmp: Path, job: str, schedule: list[list[str]], **kw: Any) -> LocalResult:
    spec = JOBS[job]
    run = LocalRun(
        script=spec["script"],
        steps=kw.pop("steps", STEPS),
        global_batch=spec["global_batch"],
        micro_batch=spec["micro_batch"],
        schedule=schedule,
        seed=3,
        timeout=kw.pop("timeout", 100.0),
        **kw,
    )
    result = run_local(run, tmp)
    return result


def ok(result: LocalResult, crashed: tuple[str, ...] = ()) -> str:
    for member, code in result.returncodes.items():
        expected = -9 if member in crashed else 0
        assert code == expected, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
    return agreed_sha(result)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    shas = {}
    for job in JOBS:
        shas[job] = ok(launch(tmp_path_factory.mktemp(f"ref-{job}"), job, [members(1)]))
    return shas


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_rank_count_does_not_change_the_numbers(
    job: str, ranks: int, reference: dict[str, str], tmp_path: Path
) -> None:
    result = launch(tmp_path, job, [members(ranks)])
    assert ok(result) == reference[job]
    sizes = {r["world_size_by_step"][str(STEPS - 1)] for r in result.results.values()}
    assert sizes == {ranks}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_shrink_then_grow_matches_the_static_run(
    job: str, reference: dict[str, str], tmp_path: Path
) -> None:
    # m3 drains at step 4; a new member m4 joins at step 8 and gets state by network.
    schedule = [members(4), members(3), [*members(3), "m4"]]
    # A scheduled run cannot back off after a false alarm as the agents do, and about one
    # run in twelve a store read of the join's epoch took over 2 s (also before the
    # transport seam; cause not found yet): the epochs' timeouts are raised instead.
    result = launch(tmp_path, job, schedule, at_step=[0, 4, 8], timeout_scale=4.0)
    assert ok(result) == reference[job]
    m0 = result.results["m0"]
    by_step = {int(k): v for k, v in m0["world_size_by_step"].items()}
    assert [by_step[s] for s in range(STEPS)] == [4] * 4 + [3] * 4 + [4] * 4
    joiner = result.results["m4"]
    assert any(r["received_state"] for r in joiner["reconfigurations"])
    # The drained member leaves at its boundary: it finishes cleanly without a result.
    assert "m3" not in result.results


def test_crash_survivors_continue_with_the_same_numbers(
    reference: dict[str, str], tmp_path: Path
) -> None:
    # m3 is SIGKILLed right after committing step 5; the others finish as three.
    result = launch(tmp_path, "mlp", [members(4), members(3)], at_step=[0, None], crash={"m3": 5})
    assert ok(result, crashed=("m3",)) == reference["mlp"]
    recon = result.results["m0"]["reconfigurations"]
    assert [r["members"] for r in recon] == [members(4), members(3)]
    assert recon[-1]["resume_step"] == 5


def test_crash_then_replacement_joins(reference: dict[str, str], tmp_path: Path) -> None:
    survivors = ["m0", "m2", "m3"]
    schedule = [members(4), survivors, [*survivors, "m9"]]
    result = launch(
        tmp_path, "transformer", schedule, at_step=[0, None, 9], crash={"m1": 3}, timeout_scale=4.0
    )
    assert ok(result, crashed=("m1",)) == reference["transformer"]


def test_a_compiled_model_keeps_its_numbers_through_a_crash_and_a_restart(
    reference: dict[str, str], tmp_path: Path
) -> None:
    """examples/transformer.py --compile (Inductor's CPU code, dropout in the graph): three
    members, one killed at step 3 and restarted from its snapshot into the compiled model,
    end with the one-member compiled run's bits."""
    compiled = ["--compile"]
    # A hang guard only: Inductor's first compile on a loaded 2-core machine with a cold
    # cache took over 100 s (twice, beside the control-plane build and other tests).
    slow = 400.0
    alone = ok(
        launch(tmp_path / "one", "transformer", [members(1)], script_args=compiled, timeout=slow)
    )
    assert alone != reference["transformer"]  # compiled kernels and RNG: not the eager bits
    result = launch(
        tmp_path / "three",
        "transformer",
        [members(3), ["m0", "m2"], members(3)],
        at_step=[0, None, 6],
        crash={"m1": 3},
        restart={"m1": 2},
        script_args=compiled,
        timeout_scale=4.0,
        timeout=slow,
    )
    assert ok(result) == alone


def test_fast_mode_deviation_is_measured(tmp_path: Path) -> None:
    finals = {}
    for ranks in (1, 3):
        out = tmp_path / f"fast-{ranks}.pt"
        result = launch(
            tmp_path / f"r{ranks}",
            "transformer",
            [members(ranks)],
            mode="fast",
            script_args=["--save", str(out)],
        )
        ok(result)
        finals[ranks] = torch.load(out)
    deviation = max(
        (finals[1][k].float() - finals[3][k].float()).abs().max().item() for k in finals[1]
    )
    print(f"fast mode: max |param difference| 1 vs 3 ranks after {STEPS} steps = {deviation:.3e}")
    # Not asserted to be zero (fast mode is not order-invariant); it must stay small.
    assert deviation < 1e-3
