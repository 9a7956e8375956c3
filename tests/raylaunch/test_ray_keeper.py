"""The keeper ends a node's whole process group when its actor's end of the pipe closes,
and otherwise reports the agent's status in its file (no Ray needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from thread_signal import signal_other_thread

# The "agent": a process that starts a "worker" child in its group and waits forever.
AGENT = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(w.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def start(tmp: Path, *command: str) -> tuple[int, int, Path]:
    """Start a keeper as the actor does; returns (its group, the pipe's write end, status)."""
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    status = tmp / "status"
    with open(tmp / "log", "ab") as log:
        keeper = [sys.executable, "-m", "keepstep.raylaunch.keeper", "--watch", str(read_end)]
        first = subprocess.Popen(
            [*keeper, "--status", str(status), "--", *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(read_end,),
            start_new_session=True,
        )
    os.close(read_end)
    assert first.wait(timeout=30) == 0
    return first.pid, write_end, status


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_closed_pipe_kills_the_whole_group(tmp_path: Path) -> None:
    group, write_end, status = start(tmp_path, sys.executable, "-c", AGENT)
    log = tmp_path / "log"
    assert wait_for(lambda: log.read_text().strip().isdigit())
    worker = int(log.read_text().split()[0])
    assert os.getpgid(worker) == group  # the worker is in the node's group
    os.close(write_end)  # the actor died
    assert wait_for(lambda: not group_alive(group) or _zombie_only(group))
    assert not status.exists()  # killed whole: nothing reported the agent's end


def test_agent_status_is_written(tmp_path: Path) -> None:
    _, write_end, status = start(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    try:
        assert wait_for(status.exists)
        assert status.read_text() == "3"
    finally:
        os.close(write_end)


def test_sigterm_is_passed_on_to_the_agent(tmp_path: Path) -> None:
    ready = "import signal, time; print('up', flush=True); time.sleep(600)"
    _, write_end, status = start(tmp_path, sys.executable, "-c", ready)
    try:
        assert wait_for(lambda: "up" in (tmp_path / "log").read_text())
        keeper = int(status.with_suffix(".pid").read_text())
        os.kill(keeper, signal.SIGTERM)
        assert wait_for(status.exists)
        assert status.read_text() == str(-signal.SIGTERM)  # the agent's end, not the keeper's
    finally:
        os.close(write_end)


def _zombie_only(group: int) -> bool:
    """Whether every process left in `group` is a zombie (dead, not yet reaped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return False
    return True


def test_sigterm_taken_by_the_watch_thread_is_passed_on(tmp_path: Path) -> None:
    # The kernel may hand a process's SIGTERM to any thread; Python runs the handler on
    # the main thread, which must not sleep in an unbounded wait for the agent's end.
    ready = "import signal, time; print('up', flush=True); time.sleep(600)"
    _, write_end, status = start(tmp_path, sys.executable, "-c", ready)
    try:
        assert wait_for(lambda: "up" in (tmp_path / "log").read_text())
        keeper = int(status.with_suffix(".pid").read_text())
        signal_other_thread(keeper, signal.SIGTERM)
        assert wait_for(status.exists, timeout=10.0)
        assert status.read_text() == str(-signal.SIGTERM)
    finally:
        os.close(write_end)
