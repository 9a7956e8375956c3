"""`keepstep selfcheck`: does this machine give the same numbers for any rank count?

Trains the bundled job once per rank count, each in fresh processes on the CPU, and
compares the sha256 of the final parameters. Users run it before relying on keepstep's
bit-identity on a new machine, image or torch build.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keepstep.errors import ConfigError
from keepstep.launch import selfcheck_job
from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local


@dataclass(frozen=True)
class SelfcheckRun:
    ranks: int
    params_sha256: str
    seconds: float
    loss: tuple[float, ...] = ()  # the logged loss of every step, as every member agreed


def selfcheck(
    ranks: Sequence[int],
    steps: int = 30,
    global_batch: int = 48,
    micro_batch: int = 4,
    mode: str = "exact",
    timeout: float = 300.0,
) -> list[SelfcheckRun]:
    """One run per rank count; each run's members must agree among themselves."""
    n_micro = global_batch // micro_batch
    for r in ranks:
        if not 1 <= r <= n_micro:
            raise ConfigError(f"ranks={r} must be between 1 and {n_micro} (the micro-batch count)")
    import time

    out = []
    with tempfile.TemporaryDirectory(prefix="keepstep-selfcheck-") as tmp:
        for r in ranks:
            members = [f"rank-{i}" for i in range(r)]
            t0 = time.perf_counter()
            result = run_local(
                LocalRun(
                    script=selfcheck_job.__file__,
                    steps=steps,
                    global_batch=global_batch,
                    micro_batch=micro_batch,
                    schedule=[members],
                    mode=mode,
                    timeout=timeout,
                ),
                Path(tmp) / f"ranks-{r}",
            )
            failed = {m: c for m, c in result.returncodes.items() if c != 0}
            if failed:
                member = next(iter(failed))
                raise ConfigError(
                    f"selfcheck with {r} ranks: {member} exited with {failed[member]}:\n"
                    + result.logs[member][-2000:]
                )
            out.append(
                SelfcheckRun(r, agreed_sha(result), time.perf_counter() - t0, _loss(result, steps))
            )
    return out


def _loss(result: LocalResult, steps: int) -> tuple[float, ...]:
    """The loss curve the members logged; ConfigError if two members logged different ones."""
    curves = {
        tuple(r["metrics_by_step"][str(s)]["loss"] for s in range(steps))
        for r in result.finished().values()
    }
    if len(curves) != 1:
        raise ConfigError(f"the members of one run logged {len(curves)} different loss curves")
    return curves.pop()
