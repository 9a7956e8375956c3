"""Throughput with one straggler: unweighted plan, weighted plan, fault-free (a simulation).

    scripts/env python bench/weighted_plan.py [--members 4] [--micro-batches 64]
        [--slow 3] [--noise 0.1] [--mb-seconds 0.05] [--collective-s 0.05] [--steps 500]
        [--time-members 1000 100000] [--repeats 7]

A SIMULATION OF THE PLAN, NOT A TRAINING RUN: nothing is trained and no time is measured.
Each member computes the micro-batches that ``plan`` gives it; each micro-batch takes
``--mb-seconds`` times its member's slowness times seeded noise (uniform +-``--noise``); a
step takes the slowest member's compute plus a fixed ``--collective-s``. The last member is
``--slow`` times slower from step 0. "weighted" folds every step's simulated timings into
``keepstep.elastic.speed`` (default policy) and plans the next step with its weights, so it
pays the time the policy takes to react. The ideal is the fault-free rate times
``(W - 1 + 1/slow) / W``: what the members' summed speed allows. It scales the collective
cost too, so with a large ``--collective-s`` a ratio can pass 1; ``--collective-s 0``
compares compute alone.

"all steps" includes the steps before the policy reacts (``window // 2 + confirm_steps``
with the slow member on an equal share); "after the replan" is the steady state. The
second table repeats the runs for several slowdowns: inside the hysteresis band (below
about 1.33x for 4 members at the default threshold of 0.2, where the slow member's share
would move by less than 20%) the plan is left alone on purpose.

The last table times the plan itself for ``--time-members`` members (4 micro-batches each):
the best CPU time of ``--repeats`` calls, equal weights and weights on the speed policy's
5% grid (most members at 1.0), beside a yardstick (a bare 1M-iteration Python loop) that
scales the figures between machines. "blocks" is ``plan_blocks``, what every member
computes (its own block is then a bisection); "spelled out" is ``plan``, which also builds
every member's list of ids. Target: 50 ms at 100,000 members.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Mapping

from keepstep.elastic.plan import plan, plan_blocks
from keepstep.elastic.speed import SpeedPolicy, SpeedState, StepTiming, observe


def _members(count: int) -> list[str]:
    return [f"n{i}" for i in range(count)]


def _simulate(
    args: argparse.Namespace, slow: float, weighted: bool
) -> tuple[float, float, SpeedState, list[int]]:
    """Steps/s over all steps and after the last replan, the final speed state, the replans."""
    rng = random.Random(args.seed)
    members = _members(args.members)
    slowness = {m: slow if m == members[-1] else 1.0 for m in members}
    state = SpeedState(SpeedPolicy(threshold=args.threshold))
    times, replans = [], []
    for step in range(args.steps):
        weights: Mapping[str, float] | None = state.weights if weighted and state.weights else None
        assignment = plan(step, members, args.micro_batches, 1, weights)
        counts = {m: len(ids) for m, ids in assignment.items()}
        compute = {
            m: sum(
                args.mb_seconds * slowness[m] * rng.uniform(1 - args.noise, 1 + args.noise)
                for _ in range(counts[m])
            )
            for m in members
        }
        times.append(max(compute.values()) + args.collective_s)
        # What the wiring will do: every member folds the same gathered timings.
        state = observe(state, step, {m: StepTiming(compute[m], counts[m]) for m in members})
        if state.replanned:
            replans.append(step)
    steady = times[replans[-1] + 1 :] if replans else times
    return len(times) / sum(times), len(steady) / sum(steady), state, replans


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    # CPU time, best of N: on a shared machine wall time would measure the neighbours too.
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times) * 1e3


def _plan_ms(
    fn: Callable[..., object],
    members: list[str],
    weights: Mapping[str, float] | None,
    repeats: int,
) -> float:
    return _best_ms(lambda: fn(0, members, 4 * len(members), 1, weights), repeats)


def time_plan(counts: list[int], repeats: int) -> None:
    loop = _best_ms(lambda: sum(1 for _ in range(1_000_000)), repeats)
    print(f"\nplan CPU time, best of {repeats}; yardstick: a 1M-iteration loop {loop:.1f} ms")
    rng = random.Random(0)
    grid = [1.05**k for k in (0, 0, 0, 0, 0, 0, -1, -2, -8, 3)]
    for count in counts:
        members = sorted(f"n{i // 8}/{i % 8}" for i in range(count))
        weights = {m: rng.choice(grid) for m in members}
        for name, fn in (("blocks", plan_blocks), ("spelled out", plan)):
            times = [_plan_ms(fn, members, w, repeats) for w in (None, weights)]
            print(
                f"  {count:>7} members  {name:<11}  equal {times[0]:7.1f} ms"
                f"   weighted {times[1]:7.1f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--slow", type=float, default=3.0, help="slowdown of the last member")
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--mb-seconds", type=float, default=0.05)
    parser.add_argument("--collective-s", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--threshold", type=float, default=SpeedPolicy().threshold)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdowns", type=float, nargs="+", default=[1.25, 1.5, 2, 3, 5, 10])
    parser.add_argument("--time-members", type=int, nargs="*", default=[1000, 100_000])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    w = args.members
    print(
        f"SIMULATION of the micro-batch plan, not a training run: {w} members, "
        f"{args.micro_batches} micro-batches/step, {args.mb_seconds * 1e3:g} ms each "
        f"+-{args.noise:.0%}, collective {args.collective_s * 1e3:g} ms, {args.steps} steps, "
        f"speed policy threshold {args.threshold:g}"
    )
    fault_free, _, _, _ = _simulate(args, 1.0, weighted=False)
    unweighted, _, _, _ = _simulate(args, args.slow, weighted=False)
    weighted, steady, state, replans = _simulate(args, args.slow, weighted=True)
    ideal = fault_free * (w - 1 + 1 / args.slow) / w
    final = plan(0, _members(w), args.micro_batches, 1, state.weights)
    print(f"\nlast member {args.slow:g}x slower from step 0 (steps/s, ratio to the ideal)")
    print(f"  fault-free                   {fault_free:7.3f}")
    print(f"  ideal (W-1+1/slow)/W         {ideal:7.3f}   1.000")
    print(f"  unweighted                   {unweighted:7.3f}   {unweighted / ideal:.3f}")
    print(
        f"  weighted, all steps          {weighted:7.3f}   {weighted / ideal:.3f}   (target >= 0.9)"
    )
    print(f"  weighted, after the replan   {steady:7.3f}   {steady / ideal:.3f}")
    print(f"  replans at steps {replans}")
    print(f"  final weights { {m: round(x, 3) for m, x in state.weights.items()} }")
    print(f"  final counts {[len(ids) for ids in final.values()]}")

    print("\nslowdown of the last member: ratio to the ideal (all steps / after the replan)")
    for slow in args.slowdowns:
        slow_ideal = fault_free * (w - 1 + 1 / slow) / w
        un, _, _, _ = _simulate(args, slow, weighted=False)
        we, we_steady, _, again = _simulate(args, slow, weighted=True)
        print(
            f"  {slow:>5g}x   unweighted {un / slow_ideal:.3f}   weighted {we / slow_ideal:.3f}"
            f" / {we_steady / slow_ideal:.3f}   replans {len(again)}"
        )
    time_plan(args.time_members, args.repeats)


if __name__ == "__main__":
    main()
