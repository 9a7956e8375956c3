"""A slow member gets fewer micro-batches, and the numbers stay those of the fault-free run.

Three members on gloo, one of them 4x slower per micro-batch (straggler_job.py), with
``balance="speed"``: the plan changes once, at a step boundary, with no rollback, and the
job ends with the same parameters as the same job without the slowdown and as one member.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

SCRIPT = str(Path(__file__).resolve().parent / "straggler_job.py")
MEMBERS = ["m0", "m1", "m2"]
STEPS = 40

pytestmark = pytest.mark.slow


def launch(tmp: Path, members: list[str], *args: str) -> LocalResult:
    run = LocalRun(
        script=SCRIPT,
        steps=STEPS,
        global_batch=48,  # 24 micro-batches: 8 each when even
        micro_batch=2,
        schedule=[members],
        seed=3,
        script_args=args,
        timeout=100.0,
    )
    result = run_local(run, tmp)
    for member, code in result.returncodes.items():
        assert code == 0, f"{member} exited {code}:\n{result.logs[member][-3000:]}"
    return result


def test_a_slow_member_gets_fewer_micro_batches_and_the_bits_stay(tmp_path: Path) -> None:
    slowed = launch(
        tmp_path / "slowed", MEMBERS, "--balance", "speed", "--slow", "m1", "--pause", "0.01"
    )
    # The references do not depend on timing: run them side by side.
    with ThreadPoolExecutor(2) as pool:
        runs = (
            pool.submit(launch, tmp_path / "even", MEMBERS),
            pool.submit(launch, tmp_path / "alone", ["m0"]),
        )
        even, alone = (r.result() for r in runs)
    assert agreed_sha(slowed) == agreed_sha(even) == agreed_sha(alone)

    results = slowed.results
    replans = {m: r["new_weights_by_step"] for m, r in results.items()}
    assert len(replans["m0"]) == 1, replans["m0"]  # exactly one replan ...
    assert all(r == replans["m0"] for r in replans.values())  # ... the same on every member
    (at,) = (int(s) for s in replans["m0"])
    counts = {m: r["micro_batches_by_step"] for m, r in results.items()}
    per_step = [{m: counts[m][str(s)] for m in MEMBERS} for s in range(STEPS)]
    assert all(c == {"m0": 8, "m1": 8, "m2": 8} for c in per_step[: at + 1])
    after = per_step[at + 1 :]
    assert after and all(c == after[0] for c in after)
    assert sum(after[0].values()) == 24
    assert 2 * after[0]["m1"] <= min(after[0]["m0"], after[0]["m2"]), after[0]
    print(f"replanned after step {at}: {per_step[at]} -> {after[0]}")


def test_a_slow_member_gets_less_newton_schulz_work_under_zero(tmp_path: Path) -> None:
    # ZeRO-1 with Muon: each matrix is stepped whole by one member, given by the plan's
    # weights, so the member the replan gives fewer micro-batches gets fewer matrices too.
    args = ("--balance", "speed", "--shard", "zero1", "--muon")
    with ThreadPoolExecutor(2) as pool:
        runs = (
            pool.submit(
                launch, tmp_path / "slowed", MEMBERS, *args, "--slow", "m1", "--pause", "0.01"
            ),
            pool.submit(launch, tmp_path / "alone", ["m0"], "--muon"),
        )
        slowed, alone = (r.result() for r in runs)
    assert agreed_sha(slowed) == agreed_sha(alone)  # unsharded, one member: the same bits
    replans = slowed.results["m0"]["new_weights_by_step"]
    assert len(replans) == 1, replans

    def cost(shape: list[int]) -> int:  # Newton-Schulz multiply-adds (zero/muon.py)
        m, n = sorted(shape)
        return 2 * m * m * n + m**3

    work = {}
    for m in MEMBERS:
        (line,) = [x for x in slowed.logs[m].splitlines() if x.startswith("DESIGNATED ")]
        work[m] = sum(cost(s) for s in json.loads(line.removeprefix("DESIGNATED ")))
    assert sum(work.values()) == 2 * cost([32, 32]) + cost([8, 32]) + cost([1, 32])
    assert work["m1"] < min(work["m0"], work["m2"]), work  # evenly, m1 would take a 32x32
