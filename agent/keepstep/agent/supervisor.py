"""Worker supervision: start a node's training processes, notice when one exits.

The supervisor knows processes, not training: it reports every exit to a callback with
the exit code and lets the agent decide (restart a crashed worker, finish on success).
Workers run in the agent's process group, so a node can be killed or stopped as a whole.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    member: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log_path: Path


class Supervisor:
    def __init__(self, on_exit: Callable[[str, int, int], None]) -> None:
        """`on_exit(member, pid, returncode)` runs on a watcher thread."""
        self.on_exit = on_exit
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self.starts: dict[str, int] = {}

    def start(self, spec: WorkerSpec, proc: subprocess.Popen[bytes] | None = None) -> int:
        """Start the worker, or adopt `proc` (a warm spare already running its command)."""
        if proc is None:
            with open(spec.log_path, "ab") as out:
                proc = subprocess.Popen(
                    list(spec.argv), env=dict(spec.env), stdout=out, stderr=subprocess.STDOUT
                )
        with self._lock:
            self._procs[spec.member] = proc
            self.starts[spec.member] = self.starts.get(spec.member, 0) + 1
        threading.Thread(
            target=self._watch, args=(spec.member, proc), name=f"watch-{spec.member}", daemon=True
        ).start()
        return proc.pid

    def _watch(self, member: str, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self._lock:
            if self._procs.get(member) is proc:
                del self._procs[member]
        self.on_exit(member, proc.pid, code)

    def pids(self) -> dict[str, int]:
        with self._lock:
            return {m: p.pid for m, p in self._procs.items()}

    def alive(self, member: str) -> bool:
        """Whether the member's process still runs, asked of the kernel now (the watcher
        thread may not have reaped a just-killed worker yet)."""
        with self._lock:
            proc = self._procs.get(member)
        return proc is not None and proc.poll() is None

    def running(self) -> int:
        with self._lock:
            return len(self._procs)

    def stop_all(self, timeout: float) -> None:
        """SIGTERM every worker, then SIGKILL what is left after `timeout`."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _signal(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
