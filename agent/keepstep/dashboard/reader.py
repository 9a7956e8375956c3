"""Reading run directories for the dashboard, including runs still being written.

`RunReader.poll()` reads only what was appended to each `events-*.jsonl` since the last
poll (node files may appear late: a joining node), keeps a line that is not finished
yet for the next poll, and picks up `faults.json` and `summary.json` when the launcher
writes them at the end. `find_runs` accepts one run directory or a folder of them.

A line that is not an event the views can use (not JSON, a line a killed node left half
written, an event without its time or with a field of the wrong type) is skipped with a
warning naming the file and line: one damaged line must not take the run, or the list of
runs, off the page.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keepstep.agent.protocol.events import EventKind
from keepstep.dashboard.data import RunInputs

log = logging.getLogger(__name__)

_NUMBER = (int, float)
# The fields the views (`data.build_view`, `protocol.recovery`) convert, by event kind:
# (name, type, required). Other fields, and kinds the views do not read, pass as they are.
_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...], bool], ...]] = {
    EventKind.COMMIT: (
        ("epoch", _NUMBER, True),
        ("step", _NUMBER, True),
        ("world_size", _NUMBER, True),
        ("step_s", _NUMBER, True),
        ("micro_batches", list, False),
        ("samples", list, False),
        ("assignment", dict, False),
    ),
    EventKind.EPOCH_AGREED: (
        ("epoch", _NUMBER, True),
        ("agree_s", _NUMBER, False),
        ("members", list, False),
        ("removed", list, False),
    ),
    EventKind.RECONFIGURED: (
        ("epoch", _NUMBER, True),
        ("resume_step", _NUMBER, True),
        ("rolled_back_steps", _NUMBER, True),
        ("communicator_s", _NUMBER, True),
        ("restore_s", _NUMBER, True),
        ("replan_s", _NUMBER, True),
    ),
    EventKind.FAULT_DETECTED: (("epoch", _NUMBER, False), ("fault_t", _NUMBER, False)),
}


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
    line: int = 0  # complete lines read so far


def parse_event(line: bytes) -> dict[str, Any] | str:
    """The event on one line of an event log, or why it is not one the views can use."""
    try:
        event = json.loads(line)
    except ValueError as error:  # JSONDecodeError, and UnicodeDecodeError for broken bytes
        return f"not JSON ({error})"
    if not isinstance(event, dict):
        return f"not a JSON object but {type(event).__name__}"
    t = event.get("t")
    if isinstance(t, bool) or not isinstance(t, _NUMBER) or not math.isfinite(t):
        return f"t={t!r} is not a time in seconds"
    kind = event.get("kind")
    if not isinstance(kind, str):
        return f"kind={kind!r} is not a string"
    for name, types, required in _FIELDS.get(kind, ()):
        if name not in event and not required:
            continue
        value = event.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            return f"a {kind} event whose {name}={value!r} is not a {_type_name(types)}"
    return event


def _type_name(types: type | tuple[type, ...]) -> str:
    return "number" if types == _NUMBER else getattr(types, "__name__", str(types))


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
            tail.line += 1
            if not line.strip():
                continue
            event = parse_event(line)
            if isinstance(event, str):  # e.g. a node killed mid-write
                log.warning("%s:%d: line skipped: %s", path, tail.line, event)
                continue
            out.append(event)
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
