"""The node's event log: one JSON object per line, with wall-clock times.

Agents append what happened (commits, detections, agreed epochs, recoveries) to
`events-<node>.jsonl` in the run directory; the run summary and the dashboard read it.
Wall-clock time is used because events of several processes are put on one timeline.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class EventLog:
    """Appends events; `listener` (telemetry) sees each one as the dict that was written."""

    def __init__(
        self, path: Path, listener: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        self.path = path
        self.listener = listener
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        event = {"t": time.time(), "kind": kind, **fields}
        line = json.dumps(event)
        with self._lock:
            self._file.write(line + "\n")
        if self.listener is not None:
            self.listener(event)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every node's events, ordered by time."""
    events: list[dict[str, Any]] = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    events.sort(key=lambda e: e["t"])
    return events
