"""Process plumbing for the runners: ports, process start times, waiting, ending process groups.

Every runner starts its nodes in sessions of their own (`start_new_session=True`), so a
node is a process group that can be killed as a whole, and ends them here by group id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class RunFailed(RuntimeError):
    """A system's run did not finish; the message says what was seen."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_start_time() -> float:
    """Wall time this process was created (before Python and torch were imported)."""
    ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
    # /proc/uptime has 10 ms resolution; /proc/stat's btime only whole seconds.
    boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def wait_for(
    cond: Callable[[], T | None],
    timeout: float,
    what: str,
    alive: Callable[[], bool] = lambda: True,
    poll: float = 0.05,
) -> T:
    """Poll `cond` until it returns a truthy value; RunFailed on timeout or when `alive` fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if not alive():
            raise RunFailed(f"the job stopped while waiting for {what}")
        time.sleep(poll)
    raise RunFailed(f"waited {timeout:.0f} s for {what} in vain")


def kill_group(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the process group `proc` leads (its session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM every group, wait up to `grace` seconds, then SIGKILL what is left,
    descendants in other sessions included."""
    below = [pid for p in procs if p.poll() is None for pid in descendants(p.pid)]
    for p in procs:
        if p.poll() is None:
            kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        kill_group(p)  # children of an exited leader may still be there
        if p.poll() is None:
            p.wait(timeout=10)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children(todo.pop(), b"")
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group and every descendant, wherever its session is
    (torchrun starts its workers in sessions of their own)."""
    below = descendants(proc.pid)
    kill_group(proc)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def children(pid: int, marker: bytes) -> list[int]:
    """Live child processes of `pid` whose command line contains `marker`."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    alive = []
    for kid in sorted(set(kids)):
        try:
            if marker in Path(f"/proc/{kid}/cmdline").read_bytes():
                alive.append(kid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return alive
