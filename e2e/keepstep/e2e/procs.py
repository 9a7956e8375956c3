"""Local server processes that can be found again by PID, and stopped by PID.

Where it sits: `controlplane.py` and `cluster.py` start every long-lived process of the
test cluster through `spawn`, keep the returned `ProcessRecord`, and later hand the records
to `stop`. A record carries the kernel's start time of the process next to its PID, so a
PID the kernel has since given to somebody else's process is never signalled; records
survive in `.e2e/state.json`, so `e2e/cluster down` can stop what an earlier `up` started.

Every process gets its own session (a Ctrl-C meant for the caller must not reach it, and
it outlives the caller when asked to). Linux only: liveness and parentage come from /proc.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PORT_ATTEMPTS = 4


class ProcessError(RuntimeError):
    """A process could not be started, or did not go away when stopped."""


class StartupError(ProcessError):
    """A component did not come up; `component` names it, the message ends with its log."""

    def __init__(self, component: str, message: str) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component


class StartupTimeout(StartupError):
    """The component runs but did not become ready in time."""


@dataclass(frozen=True)
class ProcessRecord:
    """One process we started: `name` says what it is, `log` where its output goes."""

    name: str
    pid: int
    start_ticks: int  # field 22 of /proc/<pid>/stat: tells our process from a reused PID
    log: Path

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a process record needs a non-empty name")
        if self.pid <= 1:
            raise ValueError(f"pid={self.pid} of {self.name!r} must be > 1")
        if self.start_ticks < 0:
            raise ValueError(f"start_ticks={self.start_ticks} of {self.name!r} must be >= 0")

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "log": str(self.log),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProcessRecord:
        name, pid, ticks, log = (data.get(k) for k in ("name", "pid", "start_ticks", "log"))
        if not (isinstance(name, str) and isinstance(pid, int) and isinstance(ticks, int)):
            raise ValueError(f"not a process record: {dict(data)!r}")
        if not isinstance(log, str):
            raise ValueError(f"process record {name!r} has no log path: {dict(data)!r}")
        return cls(name, pid, ticks, Path(log))


def spawn(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[ProcessRecord, subprocess.Popen[bytes]]:
    """Start `argv` in a new session, stdout and stderr appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as err:
            raise ProcessError(f"{name}: cannot run {argv[0]!r}: {err}") from err
    stat = _stat(proc.pid)
    # The child cannot have been reaped yet (only we wait for it), so /proc has it.
    ticks = 0 if stat is None else stat[2]
    return ProcessRecord(name, proc.pid, ticks, log), proc


def is_running(record: ProcessRecord) -> bool:
    """True while the process of `record` exists and is not a zombie."""
    stat = _stat(record.pid)
    if stat is None or stat[2] != record.start_ticks:
        return False
    if stat[0] != "Z":
        return True
    # A zombie leader of a multi-threaded process (Go servers) is still exiting while any
    # of its other threads lives.
    try:
        tasks = list(Path(f"/proc/{record.pid}/task").iterdir())
    except OSError:
        return False
    return any(_task_state(task) not in (None, "Z", "X") for task in tasks)


def descendants(pid: int) -> list[ProcessRecord]:
    """Every live process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append((int(entry.name), stat[2]))
    found: list[ProcessRecord] = []
    todo = [pid]
    while todo:
        for child, ticks in children.get(todo.pop(), []):
            found.append(ProcessRecord(f"child of {pid}", child, ticks, Path(os.devnull)))
            todo.append(child)
    return found


def stop(
    records: Iterable[ProcessRecord],
    *,
    timeout: float,
    popens: Mapping[int, subprocess.Popen[bytes]] | None = None,
) -> None:
    """SIGTERM every running process of `records` at once; SIGKILL what is left after
    `timeout`, and every descendant still alive once its parent is gone.

    `popens` holds our own children by PID so that they are reaped, not left as zombies.
    Raises ProcessError if a process survives SIGKILL for 10 s (stuck in the kernel).
    """
    own = dict(popens or {})
    records = list(records)
    targets = [r for r in records if is_running(r)]
    # Taken before signalling: once a parent exits its children move to init.
    family = targets + [d for r in targets for d in descendants(r.pid)]
    for record in targets:
        _signal(record, signal.SIGTERM)
    _wait_gone(targets, own, time.monotonic() + timeout)
    for record in family:
        if _running(record, own):
            _signal(record, signal.SIGKILL)
    left = _wait_gone(family, own, time.monotonic() + 10.0)
    for record in records:
        if record.pid in own:
            own[record.pid].poll()  # also reap those that had exited before we came
    if left:
        names = ", ".join(f"{r.name} (pid {r.pid})" for r in left)
        raise ProcessError(f"still running 10 s after SIGKILL: {names}")


def wait_ready(
    watched: Sequence[tuple[ProcessRecord, subprocess.Popen[bytes]]],
    ready: Callable[[], bool],
    *,
    deadline: float,
    what: str,
) -> None:
    """Poll `ready` until it holds; raise StartupError naming the first watched process
    that exits meanwhile, or the last one (the one being waited for) at `deadline`."""
    while True:
        for record, popen in watched:
            if popen.poll() is not None:
                raise StartupError(
                    record.name,
                    f"exited with status {popen.returncode} while waiting for {what}; "
                    f"log {record.log}:\n{log_tail(record.log)}",
                )
        if ready():
            return
        if time.monotonic() >= deadline:
            record = watched[-1][0]
            raise StartupTimeout(
                record.name,
                f"timed out waiting for {what}; log {record.log}:\n{log_tail(record.log)}",
            )
        time.sleep(0.1)


def start_on_free_ports(
    name: str,
    argv_for: Callable[[list[int]], list[str]],
    nports: int,
    log: Path,
    *,
    ready: Callable[[list[int]], bool],
    deadline: float,
    what: str,
    watched: Sequence[tuple[ProcessRecord, subprocess.Popen[bytes]]] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[ProcessRecord, subprocess.Popen[bytes], list[int]]:
    """Start `argv_for(ports)` on `nports` free loopback ports and wait for `ready(ports)`;
    start again on fresh ports if another process took one between our probe and its bind.
    """
    for attempt in range(_PORT_ATTEMPTS):
        ports = _free_ports(nports)
        record, popen = spawn(name, argv_for(ports), log, env=env)
        try:
            wait_ready(
                [*watched, (record, popen)],
                functools.partial(ready, ports),
                deadline=deadline,
                what=what,
            )
            return record, popen, ports
        except StartupError as err:
            stop([record], timeout=5.0, popens={record.pid: popen})
            lost_race = err.component == name and "address already in use" in str(err)
            if not lost_race or attempt + 1 == _PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the caller must cope with losing a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def log_tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _wait_gone(
    records: Sequence[ProcessRecord],
    own: Mapping[int, subprocess.Popen[bytes]],
    deadline: float,
) -> list[ProcessRecord]:
    while True:
        left = [r for r in records if _running(r, own)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _running(record: ProcessRecord, own: Mapping[int, subprocess.Popen[bytes]]) -> bool:
    # For our own child only waitpid() tells: the leader of a multi-threaded process shows
    # as a zombie while its other threads are still exiting, and is not reapable yet.
    if record.pid in own:
        return own[record.pid].poll() is None
    return is_running(record)


def _signal(record: ProcessRecord, sig: signal.Signals) -> None:
    try:
        os.kill(record.pid, sig)
    except ProcessLookupError:
        pass  # exited between the check and the signal


def _task_state(task: Path) -> str | None:
    try:
        raw = (task / "stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split(maxsplit=1)[0]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) of `pid`, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])
