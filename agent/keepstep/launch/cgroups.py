"""Control groups: throttle a node's CPU or freeze it, and put it back.

Where it sits: the launcher's slow-node fault (`launch.slowdown`) and the chaos injector's
slow-node (cpu) and hang-node (freezer) faults; the only module that writes to the cgroup
filesystem. Works on cgroup v1 (a `cpu` or `freezer`
hierarchy under /sys/fs/cgroup) and v2 (`cpu.max`, `cgroup.freeze`). Every group is
named with `PREFIX` and made beside the node's *home* cgroup: the one its first process
is in, or, when that process already sits in a group of ours (a second fault on a node
that is still slowed or frozen), that group's parent. Groups are therefore never nested,
and one fault's end can always remove its group whichever fault ends first. Processes
the node starts later (a restarted worker) are born inside the group. `release` moves
every process back to the group they were taken from while that still exists (the older
fault still lasts), else home, and removes the group within a bounded time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from keepstep.errors import KeepstepError

ROOT = Path("/sys/fs/cgroup")
PREFIX = "keepstep-chaos-"  # the name of every group the harness makes starts so
_PERIOD_US = 100_000


class CgroupUnavailable(KeepstepError):
    """This machine offers no writable cgroup for the controller; the message says why."""


class CgroupBusy(KeepstepError, OSError):
    """A group could not be removed in time: processes kept being born into it, or a
    process in it would not move. The message names the group and what is still in it."""


class Cgroup:
    """One group the harness made. `origin`: where its processes were taken from (the
    node's home, or a sibling group of an earlier fault on the same node)."""

    def __init__(
        self, path: Path, version: int, controller: str, origin: Path | None = None
    ) -> None:
        self.path = path
        self.version = version
        self.controller = controller
        self.origin = origin if origin is not None else path.parent

    @classmethod
    def create(cls, controller: str, name: str, like_pid: int) -> Cgroup:
        """A new cgroup named `name` beside the home cgroup of `like_pid` (see above)."""
        if controller not in ("cpu", "freezer"):
            raise CgroupUnavailable(f"controller {controller!r}: only cpu and freezer are used")
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"cgroup name {name!r}: must start with {PREFIX!r} and hold no '/'")
        v1 = ROOT / controller
        if (v1 / "cgroup.procs").exists():
            hierarchy = v1
            current = v1 / _v1_path(like_pid, controller).lstrip("/")
            version = 1
        else:
            hierarchy = ROOT / "unified" if (ROOT / "unified" / "cgroup.procs").exists() else ROOT
            current = hierarchy / _v1_path(like_pid, "").lstrip("/")
            version = 2
            wanted = "cpu" if controller == "cpu" else None
            have = (
                (hierarchy / "cgroup.controllers").read_text().split()
                if (hierarchy / "cgroup.controllers").exists()
                else []
            )
            if wanted and wanted not in have:
                raise CgroupUnavailable(f"cgroup v2 at {hierarchy} has no {wanted} controller")
        home = current
        while home != hierarchy and home.name.startswith(PREFIX):
            home = home.parent
        path = home / name
        try:
            path.mkdir()
        except OSError as error:
            raise CgroupUnavailable(f"cannot create {path}: {error.strerror}") from None
        return cls(path, version, controller, origin=current)

    def add(self, pids: Iterable[int]) -> None:
        error = _move(pids, self.path)
        if error is not None:
            raise error

    def limit_cpu(self, share: float) -> None:
        quota = max(int(_PERIOD_US * share), 1000)
        if self.version == 1:
            (self.path / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {_PERIOD_US}")

    def freeze(self, frozen: bool) -> None:
        if self.version == 1:
            (self.path / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        else:
            (self.path / "cgroup.freeze").write_text("1" if frozen else "0")

    def pids(self) -> list[int]:
        return _ids(self.path / "cgroup.procs")

    def threads(self) -> list[int]:
        return _ids(self.path / "tasks")

    def release(self, timeout: float = 10.0) -> None:
        """Thaw, move every process back, remove the group (and any group found inside
        it); idempotent. Raises `CgroupBusy` if it is still there after `timeout` s."""
        if not self.path.exists():
            return
        if self.controller == "freezer":
            try:
                self.freeze(False)
            except FileNotFoundError:
                return  # removed meanwhile
        back = self.origin
        if back == self.path or not (back / "cgroup.procs").exists():
            back = self.path.parent  # the fault it was taken from is over: home
        deadline = time.monotonic() + timeout
        while True:
            error = self._empty_into(back)
            if error is None:
                return
            if time.monotonic() > deadline:
                inside = {str(g): _ids(g / "cgroup.procs") for g in _groups_under(self.path)}
                raise CgroupBusy(
                    error.errno or 0, f"cgroup {self.path} not removed in {timeout} s: {inside}"
                )
            time.sleep(0.05)  # a process was being born into it, or is exiting

    def _empty_into(self, back: Path) -> OSError | None:
        """One try: move what is in the group (and in groups inside it) to `back` and
        remove them, innermost first. None once the group is gone, else the last error."""
        for group in _groups_under(self.path):
            moved = _move(_ids(group / "cgroup.procs"), back)
            if self.version == 1:
                # A thread whose leader already exited (a dying worker) cannot be moved by
                # its process id: move what is left thread by thread.
                moved = _move(_ids(group / "tasks"), back, tasks=True) or moved
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                return moved or error  # why it is still populated, if a move said so
        return None


def _groups_under(path: Path) -> list[Path]:
    """`path` and every cgroup below it, innermost first (the order they can be removed).
    Groups of ours are never nested (see above); one found inside is removed with it."""
    return [Path(top) for top, _, _ in os.walk(path, topdown=False)]


def _move(ids: Iterable[int], to: Path, tasks: bool = False) -> OSError | None:
    """Write each id into the group `to`; the last error, if one would not move."""
    target = to / ("tasks" if tasks else "cgroup.procs")
    failed = None
    for pid in ids:
        try:
            target.write_text(str(pid))
        except ProcessLookupError:
            pass  # it exited meanwhile
        except OSError as error:
            failed = error
    return failed


def _ids(path: Path) -> list[int]:
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


def _v1_path(pid: int, controller: str) -> str:
    """The cgroup path of `pid` in the hierarchy of `controller` ("" for v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (not controller and controllers == ""):
            return path
    raise CgroupUnavailable(f"process {pid} is in no {controller or 'v2'} cgroup")


def available(controller: str) -> str | None:
    """None if cgroups of `controller` can be made here, else the reason they cannot."""
    try:
        group = Cgroup.create(controller, f"{PREFIX}probe-{os.getpid()}", os.getpid())
    except (CgroupUnavailable, OSError) as error:
        return str(error)
    group.path.rmdir()
    return None
