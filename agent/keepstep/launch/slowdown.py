"""Slowing a node down from outside: a CPU quota in a cgroup, or a SIGSTOP/SIGCONT duty cycle.

Where it sits: the launcher's slow-node fault (`injector`) and the chaos injector's
(`keepstep.chaos.inject`) start one with `slow_down` on a node's process group (the
node's agent and its workers) and end it with `end()` at the fault's deadline or when the
run is over. A cgroup (`cgroups`) throttles the CPU time the node gets to `share` of one
core, and processes the node starts meanwhile (a restarted worker) are born inside it;
without cgroups (not root, none writable), the duty cycle stops the whole group `1 - share`
of every period. Each stop is far shorter than the hang timeout: the node is slow, not
lost.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from keepstep.launch.cgroups import Cgroup, CgroupUnavailable

DUTY_PERIOD_S = 0.2  # one stop and one run of the duty cycle
END_TIMEOUT_S = 2.0  # joining the duty cycle's thread


class Ongoing(Protocol):
    """An action that lasts: `end` undoes it (idempotent)."""

    def end(self) -> None: ...


def send(pid: int, sig: signal.Signals, group: bool = False) -> bool:
    """Signal a process (or its process group); False if it is gone."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class DutyCycle:
    """Slow a node down without cgroups: stop its process group `1 - share` of each period.

    Each stop is far shorter than the hang timeout, so the node is slow, not lost.
    """

    def __init__(self, pgid: int, share: float, period: float = DUTY_PERIOD_S) -> None:
        self.pgid = pgid
        self.run_s = period * share
        self.stop_s = period - self.run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="duty-cycle", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            if not send(self.pgid, signal.SIGSTOP, group=True):
                return
            self._done.wait(self.stop_s)
            send(self.pgid, signal.SIGCONT, group=True)
            self._done.wait(self.run_s)

    def end(self) -> None:
        self._done.set()
        self._thread.join(timeout=END_TIMEOUT_S)
        send(self.pgid, signal.SIGCONT, group=True)


class Throttled:
    """A node in a cgroup with a CPU quota."""

    def __init__(self, group: Cgroup) -> None:
        self.group = group

    def end(self) -> None:
        self.group.release()


@dataclass(frozen=True)
class Slowdown:
    """A started slowdown: `action.end()` lifts it; `detail` says how it was done (method,
    cpu_share, and why no cgroup was made when the duty cycle stood in)."""

    action: Ongoing
    detail: dict[str, Any] = field(default_factory=dict)


def group_pids(pgid: int) -> list[int]:
    """Every live process of the process group `pgid` (a node is one group)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # it exited meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def slow_down(
    pgid: int,
    share: float,
    method: str,
    group_name: str,
    pids: Callable[[int], Iterable[int]] = group_pids,
) -> Slowdown:
    """Slow the process group `pgid` to `share` (in (0, 1)) of a core's speed.

    `method`: cgroup, signal, or auto (cgroup where one can be made here, else signal);
    `group_name`: the cgroup's name (it must start with `cgroups.PREFIX`); `pids`: the
    processes of a process group (they are moved into the cgroup). OSError when `method`
    is cgroup and none can be made."""
    if not 0 < share < 1:
        raise ValueError(f"share {share!r} must be in (0, 1)")
    if method not in ("auto", "cgroup", "signal"):
        raise ValueError(f"method {method!r}; allowed: auto, cgroup, signal")
    detail: dict[str, Any] = {"cpu_share": share}
    if method in ("auto", "cgroup"):
        try:
            group = Cgroup.create("cpu", group_name, pgid)
        except (CgroupUnavailable, OSError) as error:
            if method == "cgroup":
                raise OSError(f"cgroup cpu throttle unavailable: {error}") from None
            detail["cgroup_unavailable"] = str(error)
        else:
            try:
                group.limit_cpu(share)
                group.add(pids(pgid))
            except OSError:
                group.release()
                raise
            return Slowdown(Throttled(group), {**detail, "method": "cgroup"})
    return Slowdown(DutyCycle(pgid, share), {**detail, "method": "signal"})
