"""bench/run --quick end to end on a tiny job: every system and every figure is reported.

Values are not checked (they depend on the machine); their presence and shape are: the
four systems, each figure the harness defines, the ratios keepstep vs each other system,
the targets, and the page with its two plots.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.assemble import FIGURES

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("ddp", "keepstep", "torchrun", "torchft")
TINY = [
    "--steps", "24", "--d-model", "16", "--layers", "1", "--heads", "1", "--seq", "8",
    "--global-batch", "20", "--micro-batch", "4", "--nodes", "3",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_reports_every_system_and_figure(tmp_path: Path) -> None:
    out, docs = tmp_path / "bench.json", tmp_path / "docs" / "benchmarks.md"
    done = subprocess.run(
        [str(REPO / "bench" / "run"), "--quick", *TINY, "--json", str(out), "--docs", str(docs)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # One progress line per run: 1 DDP, 2 keepstep, 1 torchrun, 2 TorchFT.
    assert sum(1 for line in done.stdout.splitlines() if line.startswith("[")) == 6

    report = json.loads(out.read_text())
    assert report["command"].startswith("bench/run --quick")
    assert report["machine"]["cores"] >= 1
    assert report["config"]["nodes"] == 3  # --nodes given over the preset's 4
    assert [f["kind"] for f in report["schedule"]] == ["kill-node", "kill-worker", "join-node"]
    assert set(report["systems"]) == set(SYSTEMS)
    for name in SYSTEMS:
        missing = [k for k in FIGURES if k not in report["systems"][name]]
        assert not missing, f"{name} lacks {missing}"
    for name in ("keepstep", "torchrun", "torchft"):
        faults = report["systems"][name]["faults"]
        assert {"kill-node", "kill-worker", "join-node"} <= set(faults), (name, faults)
        for kind in ("kill-node", "kill-worker"):
            assert {"mttr_p50_s", "mttr_p95_s"} <= set(faults[kind])
        assert "fraction" in report["systems"][name]["throughput_after_loss"]
        samples = report["systems"][name]["samples"]
        assert {"expected", "lost", "duplicated", "seen_once"} <= set(samples)
    assert set(report["ratios"]) == {"ddp", "torchrun", "torchft"}
    for ratios in report["ratios"].values():
        assert {"step_time_keepstep_over_other", "mttr_p50_other_over_keepstep"} <= set(ratios)
    assert set(report["targets"]) == {
        "mttr_10x_lower_than_torchrun",
        "keepstep_no_lost_or_duplicated",
        "torchft_loses_or_duplicates",
        "keepstep_step_time_within_10pct_of_ddp",
        "keepstep_param_deviation_zero",
    }
    by_round = report["targets"]["keepstep_step_time_within_10pct_of_ddp"]["ratio_by_round"]
    assert len(by_round) == report["config"]["repeats"]
    page = docs.read_text()
    assert report["command"] in page
    for plot in ("loss_curves.svg", "throughput.svg"):
        assert f"plots/{plot}" in page
        assert (docs.parent / "plots" / plot).read_text().startswith("<svg")
