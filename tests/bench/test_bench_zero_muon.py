"""bench/zero_muon.py on a tiny decoder: it runs and reports what sharded Muon costs.

Times are not checked (they depend on the machine); the counts and bytes that follow from
the shapes and the job's ownership are: every matrix stepped on one member, the
Newton-Schulz work split so the largest share is at most the largest matrix's above an
even split, momentum and traffic shrinking with the member count, and the all-to-all
receiving less than an all-gather would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "zero_muon.py"


def test_the_bench_reports_each_members_share() -> None:
    argv = ["--d-model", "64", "--layers", "2", "--members", "1", "2", "4", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    rows = {r["members"]: r for r in json.loads(line[len("RESULT ") :])["rows"]}
    assert rows[1]["designated_max"] == 8 and rows[1]["ns_cost_share_max"] == 1.0
    assert rows[1]["sent_mb_max"] == rows[1]["recv_mb_max"] == 0.0
    assert rows[2]["designated_max"] == 4 and rows[4]["designated_max"] == 2
    assert rows[4]["ns_cost_share_max"] <= 0.5
    full = rows[1]["momentum_mb_max"]
    assert rows[4]["momentum_mb_max"] < rows[2]["momentum_mb_max"] < full
    for world in (2, 4):
        assert 0 < rows[world]["recv_mb_max"] < rows[world]["allgather_recv_mb_max"]
        # a member 4x slower (the default): designated by speed, the path is no longer
        assert rows[world]["slow_by_speed_s"] <= rows[world]["slow_by_cost_s"]
