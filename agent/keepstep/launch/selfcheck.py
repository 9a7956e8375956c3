"""`keepstep selfcheck`: does this machine give the same numbers for any rank count?

Trains the bundled job once per rank count, each in fresh processes on the CPU, and
compares the sha256 of the final parameters. Users run it before relying on keepstep's
bit-identity on a new machine, image or torch build. With ``shard`` every run shards the
optimizer state that way, and one more run, unsharded on one rank, comes first: the
sharded runs must equal it too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keepstep.errors import ConfigError
from keepstep.launch import selfcheck_job
from keepstep.launch.local import LocalResult, LocalRun, agreed_sha, run_local

SHARDS = ("zero1", "zero2")  # what `init(shard=)` accepts besides None


@dataclass(frozen=True)
class SelfcheckRun:
    ranks: int
    params_sha256: str
    seconds: float
    loss: tuple[float, ...] = ()  # the logged loss of every step, as every member agreed
    shard: str | None = None  # how its optimizer state was held (None: full replicas)
    # Sharded: the share of the optimizer's elements each member stepped at the end.
    stepped_share: tuple[float, ...] = ()


def selfcheck(
    ranks: Sequence[int],
    steps: int = 30,
    global_batch: int = 48,
    micro_batch: int = 4,
    mode: str = "exact",
    timeout: float = 300.0,
    shard: str | None = None,
) -> list[SelfcheckRun]:
    """One run per rank count; each run's members must agree among themselves. With
    ``shard`` (``"zero1"``, ``"zero2"``) the runs shard their optimizer state, after one
    unsharded run on one rank that they are compared with."""
    n_micro = global_batch // micro_batch
    for r in ranks:
        if not 1 <= r <= n_micro:
            raise ConfigError(f"ranks={r} must be between 1 and {n_micro} (the micro-batch count)")
    if shard is not None and shard not in SHARDS:
        raise ConfigError(f"shard={shard!r} is not one of: {', '.join(SHARDS)} (or None)")
    import time

    runs: list[tuple[int, str | None]] = [(r, shard) for r in ranks]
    if shard is not None:
        runs.insert(0, (1, None))
    out = []
    with tempfile.TemporaryDirectory(prefix="keepstep-selfcheck-") as tmp:
        for r, held in runs:
            members = [f"rank-{i}" for i in range(r)]
            env = dict(os.environ)
            env.pop("KEEPSTEP_SHARD", None)  # the run's own setting, not the caller's
            if held is not None:
                env["KEEPSTEP_SHARD"] = held
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
                Path(tmp) / f"ranks-{r}-{held or 'full'}",
                env,
            )
            failed = {m: c for m, c in result.returncodes.items() if c != 0}
            if failed:
                member = next(iter(failed))
                raise ConfigError(
                    f"selfcheck with {r} ranks (shard={held}): {member} exited with "
                    f"{failed[member]}:\n" + result.logs[member][-2000:]
                )
            seconds = time.perf_counter() - t0
            share = _stepped_share(result, held, _param_count()) if held else ()
            out.append(
                SelfcheckRun(r, agreed_sha(result), seconds, _loss(result, steps), held, share)
            )
    return out


def _param_count() -> int:
    return sum(p.numel() for p in selfcheck_job.build_model().parameters())


def _stepped_share(result: LocalResult, shard: str, total: int) -> tuple[float, ...]:
    """Each member's share of the optimizer's elements in its last epoch; ConfigError if
    a member stepped all of them alone (the run did not shard)."""
    shares = []
    for member, r in sorted(result.finished().items()):
        stepped = r["reconfigurations"][-1]["stepped_elements"]
        if stepped is None or (stepped >= total and len(result.finished()) > 1):
            raise ConfigError(f"{member} stepped {stepped} of {total} elements with shard={shard}")
        shares.append(round(stepped / total, 4))
    return tuple(shares)


def _loss(result: LocalResult, steps: int) -> tuple[float, ...]:
    """The loss curve the members logged; ConfigError if two members logged different ones."""
    curves = {
        tuple(r["metrics_by_step"][str(s)]["loss"] for s in range(steps))
        for r in result.finished().values()
    }
    if len(curves) != 1:
        raise ConfigError(f"the members of one run logged {len(curves)} different loss curves")
    return curves.pop()
