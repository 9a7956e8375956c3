"""Worker supervision: start a node's training processes, notice when one exits.

The supervisor knows processes, not training: it reports every exit to a callback with
the exit code, and `after_exit` decides what the agent does about it (restart a crashed
worker, let a finished one go). Workers run in the agent's process group, so a node can
be killed or stopped as a whole. `owns` tells the link server whether a connecting process
is one of the agent's own.
"""

from __future__ import annotations

import enum
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

    def owns(self, pid: int) -> bool:
        """Whether `pid` is one of this agent's processes: a worker or a warm spare (its
        children), a process one of them started, or the agent itself.

        Asked of the kernel's process tree rather than of the table of workers: a warm
        spare runs its worker's script a moment before `start` adopts it, and a worker's
        command may be a wrapper whose child talks to the agent. No process outside the
        agent's tree can enter it.
        """
        return descends_from(pid, os.getpid())

    def alive(self, member: str) -> bool:
        """Whether the member's process still runs, asked of the kernel now: on a loaded
        machine the watcher thread may learn of a kill long after the probes ask."""
        with self._lock:
            proc = self._procs.get(member)
        return proc is not None and running(proc.pid)

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


# How far up the process tree `descends_from` looks (a wrapper or two, then the worker).
MAX_DEPTH = 32


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or below it (its parent's parent ...), from /proc.
    A process that cannot be read (gone, another pid namespace) does not."""
    for _ in range(MAX_DEPTH):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        parent = _parent(pid)
        if parent is None:
            return False
        pid = parent
    return False


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
    # the last ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def running(pid: int) -> bool:
    """Whether our child `pid` has not exited and is not on its way out, without reaping it.

    Not `Popen.poll()`: it answers None ("running") whenever another thread waits on the
    process, and the watcher always does, so a killed worker whose watcher had not got
    the GIL yet was offered to the next epoch as ready. Nor only `waitid`: a SIGKILLed
    worker with torch's threads takes 100-200 ms on a loaded machine to become a zombie,
    and an epoch agreed meanwhile kept it ("lost nothing"); a process with a SIGKILL
    pending or already exiting (the kernel's PF_EXITING) counts as gone.
    """
    try:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return False
    except ChildProcessError:
        return False  # reaped already: it exited
    return not dying(pid)


_PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def dying(pid: int) -> bool:
    """Whether the kernel says `pid` is exiting or has a SIGKILL pending (False if /proc
    cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            status = f.read()
    except OSError:
        return False
    return exiting_in(stat, status)


def exiting_in(stat: str, status: str) -> bool:
    """`dying` on the text of /proc/<pid>/stat and /proc/<pid>/status."""
    fields = stat.rpartition(")")[2].split()  # after the command, which may hold spaces
    try:
        if int(fields[6]) & _PF_EXITING:  # the 9th field of stat: flags
            return True
    except (IndexError, ValueError):
        return False
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd"):
            try:
                if int(value.strip(), 16) & _SIGKILL_BIT:
                    return True
            except ValueError:
                continue
    return False


class ExitAction(enum.Enum):
    """What the agent does about a worker that exited."""

    DONE = "done"  # its part in the job is over: it finished, or left the job
    RESTART = "restart"  # it crashed: start it again (it restores from shared memory)
    GIVE_UP = "give-up"  # it crashed too often in a row, or while its node drains


@dataclass(frozen=True)
class ExitDecision:
    action: ExitAction
    abort: bool  # the epoch it was a member of must end now
    reason: str


def describe_exit(code: int) -> str:
    """An exit status as people read it: "code 1" or "signal SIGABRT"."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def after_exit(
    member: str,
    code: int,
    *,
    finished: bool,
    in_epoch: bool,
    draining: bool,
    restarts: int,
    max_restarts: int,
    refused: str | None = None,
) -> ExitDecision:
    """Decide about a worker's exit. `finished`: its finish (final step and parameters)
    was recorded; `in_epoch`: it is a member of the current epoch; `restarts`: crashes in
    a row so far; `refused`: the error no restart mends it recorded (keepstep/fatal.py),
    which ends it for good at once.

    A finished worker is done whatever its exit status: training is over, and a process
    can still die on its way out (a c10d call of an abandoned epoch failing while the
    interpreter shuts down aborts it). Restarting it would add an epoch to a job that has
    ended. A worker that exits 0 without finishing left the job (drained, or the job
    ended while it waited to be admitted).
    """
    how = describe_exit(code)
    if finished:
        note = "" if code == 0 else f", then exited with {how}"
        return ExitDecision(ExitAction.DONE, False, f"{member} finished{note}")
    if code == 0:
        return ExitDecision(ExitAction.DONE, False, f"{member} left the job")
    if refused is not None:
        return ExitDecision(
            ExitAction.GIVE_UP, in_epoch, f"{member} exited with {how} on {refused}"
        )
    if draining:
        return ExitDecision(
            ExitAction.GIVE_UP, in_epoch, f"{member} exited with {how} while its node drains"
        )
    if restarts >= max_restarts:
        return ExitDecision(
            ExitAction.GIVE_UP,
            in_epoch,
            f"{member} exited with {how} after {restarts} restarts in a row",
        )
    return ExitDecision(
        ExitAction.RESTART,
        in_epoch,
        f"{member} exited with {how}: restart {restarts + 1} of {max_restarts}",
    )


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
