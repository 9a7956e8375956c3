"""Control groups for chaos: throttle a node's CPU or freeze it, and put it back.

Where it sits: the injector's slow-node (cpu) and hang-node (freezer) faults; the only
module that writes to the cgroup filesystem. Works on cgroup v1 (a `cpu` or `freezer`
hierarchy under /sys/fs/cgroup) and v2 (`cpu.max`, `cgroup.freeze`). A group is created
beside the cgroup the node's first process is in; processes the node starts later
(a restarted worker) are born inside it. `release` moves every process back to that
parent and removes the group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from keepstep.elastic.errors import KeepstepError

ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


class CgroupUnavailable(KeepstepError):
    """This machine offers no writable cgroup for the controller; the message says why."""


class Cgroup:
    def __init__(self, path: Path, version: int, controller: str) -> None:
        self.path = path
        self.version = version
        self.controller = controller

    @classmethod
    def create(cls, controller: str, name: str, like_pid: int) -> Cgroup:
        """A new cgroup named `name` beside the one `like_pid` is in."""
        if controller not in ("cpu", "freezer"):
            raise CgroupUnavailable(f"controller {controller!r}: only cpu and freezer are used")
        v1 = ROOT / controller
        if (v1 / "cgroup.procs").exists():
            parent = v1 / _v1_path(like_pid, controller).lstrip("/")
            version = 1
        else:
            unified = ROOT / "unified" if (ROOT / "unified" / "cgroup.procs").exists() else ROOT
            parent = unified / _v1_path(like_pid, "").lstrip("/")
            version = 2
            wanted = "cpu" if controller == "cpu" else None
            have = (
                (unified / "cgroup.controllers").read_text().split()
                if (unified / "cgroup.controllers").exists()
                else []
            )
            if wanted and wanted not in have:
                raise CgroupUnavailable(f"cgroup v2 at {unified} has no {wanted} controller")
        path = parent / name
        try:
            path.mkdir()
        except OSError as error:
            raise CgroupUnavailable(f"cannot create {path}: {error.strerror}") from None
        return cls(path, version, controller)

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass  # it exited meanwhile

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
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def threads(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "tasks").read_text().split()]
        except OSError:
            return []

    def release(self, timeout: float = 10.0) -> None:
        """Thaw, lift limits, move every process back to the parent, remove the group."""
        if not self.path.exists():
            return
        if self.controller == "freezer":
            self.freeze(False)
        deadline = time.monotonic() + timeout
        while True:
            Cgroup(self.path.parent, self.version, self.controller).add(self.pids())
            if self.version == 1:
                # A thread whose leader already exited (a dying worker) cannot be moved by
                # its process id: move what is left thread by thread.
                for tid in self.threads():
                    try:
                        (self.path.parent / "tasks").write_text(str(tid))
                    except ProcessLookupError:
                        pass
            try:
                self.path.rmdir()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # a process was being born into it, or is exiting


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
        group = Cgroup.create(controller, f"keepstep-chaos-probe-{os.getpid()}", os.getpid())
    except (CgroupUnavailable, OSError) as error:
        return str(error)
    group.path.rmdir()
    return None
