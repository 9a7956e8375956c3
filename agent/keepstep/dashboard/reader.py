"""Reading run directories for the dashboard, including runs still being written.

`RunReader.poll()` reads only what was appended to each `events-*.jsonl` since the last
poll (node files may appear late: a joining node), keeps a line that is not finished
yet for the next poll, and picks up `faults.json` and `summary.json` when the launcher
writes them at the end. `find_runs` accepts one run directory or a folder of them.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstep.dashboard.data import RunInputs


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("events-*.jsonl")) or (path / "summary.json").exists())


def find_runs(root: Path) -> dict[str, Path]:
    """Run name -> directory: `root` itself if it is a run, else its run subfolders."""
    if is_run_dir(root):
        return {root.name: root}
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if is_run_dir(p)}


@dataclass
class _Tail:
    offset: int = 0
    rest: bytes = b""


class RunReader:
    """One run directory; thread-safe, so the HTTP server's threads can share it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._tails: dict[Path, _Tail] = {}
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._steps_total: int | None = None

    def poll(self) -> RunInputs:
        """Everything known about the run now (new event lines are read, old ones kept)."""
        with self._lock:
            fresh: list[dict[str, Any]] = []
            for path in sorted(self.run_dir.glob("events-*.jsonl")):
                fresh.extend(self._read_new(path))
            if fresh:
                self._events.extend(fresh)
                self._events.sort(key=lambda e: float(e["t"]))
            summary = _load_json(self.run_dir / "summary.json")
            faults = _load_json(self.run_dir / "faults.json")
            if self._steps_total is None:
                self._steps_total = _configured_steps(self.run_dir)
            return RunInputs(
                name=self.run_dir.name,
                events=tuple(self._events),
                faults=tuple(faults) if isinstance(faults, list) else (),
                summary=summary if isinstance(summary, dict) else None,
                steps_total=self._steps_total,
            )

    def _read_new(self, path: Path) -> list[dict[str, Any]]:
        tail = self._tails.setdefault(path, _Tail())
        try:
            with open(path, "rb") as f:
                f.seek(tail.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        tail.offset += len(chunk)
        data = tail.rest + chunk
        lines = data.split(b"\n")
        tail.rest = lines.pop()  # b"" when the file ends with a newline
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a damaged line (a node killed mid-write) is skipped
        return out


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        # Absent while the run is live; half-written for an instant at its end.
        return None


def _configured_steps(run_dir: Path) -> int | None:
    """The job's step count, from the agent configuration the launcher left in the run."""
    for path in sorted(run_dir.glob("agent-*.json")):
        config = _load_json(path)
        if isinstance(config, dict) and isinstance(config.get("steps"), int):
            return int(config["steps"])
    return None
