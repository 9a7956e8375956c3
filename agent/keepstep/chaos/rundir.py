"""What a running `keepstep run` shows from outside: its run directory and its processes.

Where it sits: the injector (`inject.py`) polls a `RunView` to fire faults at a step, a
time or a detection, and to find the process ids a fault acts on; the runner uses the
process helpers to check that nothing is left behind. Everything is read from the run
directory's public files (the nodes' event logs, `agent-<node>.json`, the records of its
durable checkpoints, whose hashes are noted before the writer prunes them) and from /proc.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepstep.agent.durable.storage import CheckpointInfo, info_name, step_files
from keepstep.agent.protocol.events import EventKind, kind_of
from keepstep.errors import KeepstepError

# What shows that the job noticed a fault (a `during_recovery_of` trigger fires on it).
DETECTIONS = frozenset(
    {EventKind.FAULT_DETECTED, EventKind.DRAIN_REQUESTED, EventKind.EPOCH_AGREED}
)
CHECKPOINTS = "checkpoints"  # the run's durable checkpoints, when the job asks for them


@dataclass
class RunView:
    """Incrementally read event logs of one run directory (one reader thread)."""

    run_dir: Path
    step: int = 0  # steps committed by the job so far (the highest committed step + 1)
    first_commit_t: float | None = None
    agents: dict[str, int] = field(default_factory=dict)  # node -> agent pid
    workers: dict[str, int] = field(default_factory=dict)  # member -> pid of a live worker
    detections: list[float] = field(default_factory=list)  # times of detections, agreements
    finished: int = 0
    checkpoints: dict[int, str] = field(default_factory=dict)  # step -> sha256 of its state
    _offsets: dict[Path, int] = field(default_factory=dict)
    _partial: dict[Path, bytes] = field(default_factory=dict)

    def poll(self) -> list[dict[str, Any]]:
        """Read the events appended since the last poll (complete lines only)."""
        new: list[dict[str, Any]] = []
        for path in sorted(self.run_dir.glob("events-*.jsonl")):
            at = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(at)
                    chunk = f.read()
            except OSError:
                continue
            self._offsets[path] = at + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                if line.strip():
                    new.append(json.loads(line))
        new.sort(key=lambda e: float(e["t"]))
        for event in new:
            self._apply(event)
        self._read_checkpoints()
        return new

    def _read_checkpoints(self) -> None:
        """Note each published checkpoint's hash: the writer keeps only the newest few."""
        folder = self.run_dir / CHECKPOINTS
        if not folder.is_dir():
            return
        for step, names in step_files([p.name for p in folder.iterdir()]).items():
            path = folder / info_name(step)  # the step's record, not a sharded part's
            if step in self.checkpoints or path.name not in names:
                continue
            try:
                info = CheckpointInfo.from_json(path.read_bytes(), str(path))
            except (OSError, KeepstepError):
                continue  # being written or already pruned: the next poll decides
            self.checkpoints[step] = info.sha256

    def _apply(self, e: dict[str, Any]) -> None:
        kind = kind_of(e)
        if kind is EventKind.COMMIT:
            self.step = max(self.step, int(e["step"]) + 1)
            if self.first_commit_t is None:
                self.first_commit_t = float(e["t"])
        elif kind is EventKind.AGENT_STARTED:
            self.agents[str(e["node"])] = int(e["pid"])
        elif kind is EventKind.WORKER_STARTED:
            self.workers[str(e["member"])] = int(e["pid"])
        elif kind is EventKind.WORKER_EXITED:
            if self.workers.get(str(e["member"])) == int(e["pid"]):
                del self.workers[str(e["member"])]
        elif kind is EventKind.FINISH:
            self.finished += 1
        if kind in DETECTIONS:
            self.detections.append(float(e["t"]))

    def worker_pid(self, node: str) -> int | None:
        """The node's first live worker, by the events (None if it has none now)."""
        return self.workers.get(f"{node}/0")

    def job_id(self, node: str = "n0") -> str | None:
        try:
            return str(json.loads((self.run_dir / f"agent-{node}.json").read_text())["job"])
        except (OSError, ValueError, KeyError):
            return None

    def etcd_access(self, node: str = "n0") -> tuple[str, str, str | None] | None:
        """(job, etcd endpoints, credentials folder or None) from the node's agent
        configuration; None until it is written."""
        try:
            raw = json.loads((self.run_dir / f"agent-{node}.json").read_text())
            return str(raw["job"]), str(raw["etcd"]), raw.get("etcd_tls") or None
        except (OSError, ValueError, KeyError):
            return None

    def snapshot_dir(self, node: str) -> Path:
        try:
            raw = json.loads((self.run_dir / f"agent-{node}.json").read_text())
            return Path(raw.get("snapshot_dir") or "/dev/shm")
        except (OSError, ValueError):
            return Path("/dev/shm")


# -- processes ----------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting for its parent."""
    state = _stat(pid)
    return state is not None and state[0] not in ("Z", "X")


def process_group(pgid: int) -> list[int]:
    """Every live process of a process group (a simulated node is one group)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = _stat(int(entry))
            if state is not None and state[2] == pgid and state[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def children_matching(ppid: int, needle: str) -> list[int]:
    """Live children of `ppid` whose command line contains `needle`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        state = _stat(int(entry))
        if state is None or state[1] != ppid or state[0] in ("Z", "X"):
            continue
        if needle in command_line(int(entry)):
            out.append(int(entry))
    return out


def command_line(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) from /proc/PID/stat, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])
