"""Plumbing of `agreement_scale.py`: host processes, etcd's counters, the report table.

A host process runs the bench's script with `--child` and answers one JSON line per
command; the bench reads etcd's /metrics before and after each loss.
"""

from __future__ import annotations

import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

# etcd's own counters, summed over their label sets (see `scrape`).
METRICS = {
    "proposals": "etcd_server_proposals_committed_total",
    "puts": "etcd_mvcc_put_total",
    "deletes": "etcd_mvcc_delete_total",
    "events_sent": "etcd_debugging_mvcc_events_total",
}
REPLY_TIMEOUT_S = 300.0  # the longest a host may take over one command (1,000 agents)


class Child:
    """A host process seen from the bench, with a bounded wait on each answer."""

    def __init__(self, script: str, opts: dict[str, Any]) -> None:
        argv = [sys.executable, script, "--child", json.dumps(opts)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self.answer(REPLY_TIMEOUT_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply: dict[str, Any] = json.loads(self.lines.get(timeout=1.0))
                return reply
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"host pid {self.proc.pid} exited") from None
        raise TimeoutError(f"host pid {self.proc.pid} silent for {timeout:g} s")

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def scrape(metrics_endpoint: str) -> dict[str, float]:
    """etcd's counters named in METRICS, each summed over its label sets."""
    with urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for short, name in METRICS.items():
            if line.startswith(name) and line[len(name)] in " {":
                out[short] += float(line.rsplit(" ", 1)[1])
    return out


def summarize(
    n: int, procs: int, deciders: int, setup_s: float, losses: list[Any]
) -> dict[str, Any]:
    delays = [loss["p50_s"] for loss in losses]
    worst = [loss["max_s"] for loss in losses]
    mean = {k: statistics.mean(loss[k] for loss in losses) for k in (*METRICS, "events_received")}
    return {
        "agents": n, "procs": procs, "deciders": deciders or n, "setup_s": setup_s,
        "p50_s": statistics.median(delays), "max_s": max(worst), "per_loss": mean,
        "losses": losses,
    }  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'agents':>7} {'deciders':>8} {'p50 ms':>8} {'max ms':>8} {'proposals':>9} "
        f"{'keys put':>8} {'deleted':>7} {'events sent':>11} {'received':>9} {'setup s':>8}"
    )
    rows = [head]
    for r in results:
        m = r["per_loss"]
        rows.append(
            f"{r['agents']:>7} {r['deciders']:>8} {r['p50_s'] * 1e3:>8.0f} "
            f"{r['max_s'] * 1e3:>8.0f} {m['proposals']:>9.1f} {m['puts']:>8.1f} "
            f"{m['deletes']:>7.1f} {m['events_sent']:>11.1f} "
            f"{m['events_received']:>9.1f} {r['setup_s']:>8.1f}"
        )
    return "\n".join(rows)
