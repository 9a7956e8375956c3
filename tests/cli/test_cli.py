"""The `keepstep` command line: selfcheck and argument errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from keepstep.cli import build_parser


def keepstep(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keepstep", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_selfcheck_reports_identical_parameters_across_rank_counts() -> None:
    # Its script clips by global norm and logs its loss: both must not see the rank count.
    proc = keepstep("selfcheck", "--ranks", "1,2,3,4", "--steps", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["ranks"] for r in report["runs"]] == [1, 2, 3, 4]
    assert report["identical"] is True
    assert len({r["params_sha256"] for r in report["runs"]}) == 1
    losses = [r["loss"] for r in report["runs"]]
    assert len(losses[0]) == 6 and all(loss == losses[0] for loss in losses)


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_selfcheck_shard_matches_the_unsharded_run(shard: str) -> None:
    proc = keepstep("selfcheck", "--shard", shard, "--ranks", "3", "--steps", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    # The unsharded one-rank run first, then the sharded runs it is compared with.
    assert [(r["ranks"], r["shard"]) for r in report["runs"]] == [(1, None), (3, shard)]
    assert report["identical"] is True
    assert len({r["params_sha256"] for r in report["runs"]}) == 1
    assert len({tuple(r["loss"]) for r in report["runs"]}) == 1
    # Each member stepped its own share of the optimizer's elements, together all of them.
    # The selfcheck's model is tiny (a few chunks of 128 elements, most tensors far smaller
    # than one), so the chunked layout balances it only roughly: no member steps them all.
    shares = [r["stepped_share"] for r in report["runs"]]
    assert shares[0] == [] and len(shares[1]) == 3
    assert min(shares[1]) > 0.05 and max(shares[1]) < 0.75
    assert sum(shares[1]) == pytest.approx(1.0, abs=1e-3)


def test_selfcheck_refuses_an_unknown_shard() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["selfcheck", "--shard", "zero3"])


def test_selfcheck_refuses_more_ranks_than_micro_batches() -> None:
    proc = keepstep("selfcheck", "--ranks", "1,13", "--steps", "2")
    assert proc.returncode == 2
    assert "ranks=13 must be between 1 and 12" in proc.stderr


def test_bad_rank_list_is_named() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["selfcheck", "--ranks", "1,x"])
