"""The fault actions the chaos injector applies from outside a run's processes.

Where it sits: `inject.py` decides *when*; this module does *what*, on process ids and
files of one run: signals to a process or a node's process group, a SIGSTOP/SIGCONT duty
cycle (a slow node without cgroups), a node's veth taken down (a partition, with
`keepstep run --netns`), flipping bytes in a worker's snapshot, choosing which etcd member
to kill (`etcd_victim`) and bringing a killed etcd back with its own command line. Each
long-lived action is an object with `end()`, so the injector can undo it at its deadline
or when the run is over.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from keepstep.elastic.snapshot_layout import (
    FILE_STRUCT,
    HEADER,
    SLOT_STRUCT,
    SlotState,
    slot_intact,
)
from keepstep.launch import netns
from keepstep.launch.cgroups import Cgroup
from keepstep.launch.etcd_cluster import metrics

# The slow-downs are the launcher's too (`keepstep run --fault slow-node:...`); they live
# in keepstep.launch, which may not import chaos, and are used from here by these names.
from keepstep.launch.slowdown import DutyCycle, Ongoing, Throttled, send

__all__ = ["DutyCycle", "Held", "Ongoing", "Stopped", "Throttled", "send"]


class Held(Ongoing, Protocol):
    """A hung node: `end` lets it run again, `kill` ends it for good."""

    def kill(self) -> None: ...


class Stopped:
    """A node's process group held with SIGSTOP (a hang), or frozen in a cgroup."""

    def __init__(self, pgid: int, freezer: Cgroup | None = None) -> None:
        self.pgid = pgid
        self.freezer = freezer
        self._ended = False

    def end(self) -> None:
        """Let the node run again (a hang that resumes)."""
        if self._ended:
            return
        self._ended = True
        if self.freezer is not None:
            self.freezer.release()
        else:
            send(self.pgid, signal.SIGCONT, group=True)

    def kill(self) -> None:
        """End the node for good: SIGKILL is delivered once the group runs again."""
        send(self.pgid, signal.SIGKILL, group=True)
        self.end()


class Partitioned:
    """A node cut off the network: the root end of its veth is down, so every packet to
    or from its namespace is dropped. Its connections stall as on a real partition (no
    reset) and carry on when the link is back, unless a side gave up on them meanwhile."""

    def __init__(self, ip: str, veth: str) -> None:
        self.ip = ip
        self.veth = veth
        self._ended = False
        netns.set_link(ip, veth, up=False)

    def end(self) -> None:
        """Reconnect the node."""
        if self._ended:
            return
        self._ended = True
        netns.set_link(self.ip, self.veth, up=True)


def corrupt_newest_slot(path: Path) -> dict[str, Any]:
    """Flip bytes in the payload of the newest valid slot of a snapshot file.

    Returns what was done and whether the snapshot store now refuses that slot (its
    checksum no longer matches): the run must then go on from the other slot or a peer.
    """
    with open(path, "r+b") as f:
        head = f.read(HEADER)
        slot_size = int(FILE_STRUCT.unpack_from(head, 0)[3])
        slots = []
        for slot in (0, 1):
            at = HEADER + slot * slot_size
            f.seek(at)
            _, state, _, step, nbytes, _, gen = SLOT_STRUCT.unpack(f.read(SLOT_STRUCT.size))
            if state == SlotState.VALID and nbytes > 0:
                slots.append((gen, slot, at, step, nbytes))
        if not slots:
            return {"corrupted": False, "reason": "no valid slot yet"}
        _, slot, at, step, nbytes = max(slots)
        # The middle of the payload is tensor data: a silent flip there would change numbers.
        where = at + HEADER + nbytes // 2
        f.seek(where)
        original = f.read(8)
        f.seek(where)
        f.write(bytes(b ^ 0xFF for b in original))
        f.flush()
    return {
        "corrupted": True,
        "slot": slot,
        "slot_step": step,
        "offset": where,
        "bytes": len(original),
        "store_refuses_slot": _refused(path, slot),
    }


def _refused(path: Path, slot: int) -> bool:
    """Whether the snapshot store's own check (state and checksum) now refuses the slot."""
    return not slot_intact(memoryview(path.read_bytes()), slot)


@dataclass(frozen=True)
class EtcdMember:
    """One live etcd process of the run, as its command line and /metrics describe it."""

    pid: int
    name: str
    endpoint: str  # "host:port" of its client URL
    leader: bool | None  # None: it did not answer


def etcd_member(pid: int, timeout: float = 1.0) -> EtcdMember:
    """Describe the etcd with this pid (its flags say its name and client URL)."""
    argv, _ = etcd_command(pid)
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in argv[1:] if a.startswith("--"))
    endpoint = flags.get("listen-client-urls", "").split(",")[0].split("://")[-1]
    # Beside TLS, /metrics is served over plain HTTP on its own port.
    plain = flags.get("listen-metrics-urls", "").split(",")[0].removeprefix("http://")
    seen = metrics(plain or endpoint, timeout) if endpoint else None
    leader = None if seen is None else seen.get("etcd_server_is_leader") == 1.0
    return EtcdMember(pid, flags.get("name", ""), endpoint, leader)


def etcd_victim(members: Sequence[EtcdMember]) -> tuple[EtcdMember, str]:
    """The member a kill-etcd fault takes, and why. Of several, the leader: its loss is
    the harder one, since besides the client connections it held (every client balances
    over all members) it stops every write until the survivors elect a new leader; a
    follower's loss only moves streams. Mid-election (no member leads) the first by name,
    so the choice is still the same for the same observation."""
    if not members:
        raise ValueError("no live etcd member to kill")
    if len(members) == 1:
        return members[0], "the run's only etcd"
    leaders = [m for m in members if m.leader]
    if leaders:
        return leaders[0], f"the leader of {len(members)} live members"
    first = min(members, key=lambda m: m.name)
    return first, f"the first by name of {len(members)} live members: none said it leads"


def etcd_command(pid: int) -> tuple[list[str], str]:
    """A running etcd's command line and working directory, to start it again later."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return [a.decode() for a in argv if a], os.readlink(f"/proc/{pid}/cwd")


class RestartedEtcd:
    """etcd started again on the same data directory and ports (its member restarted)."""

    def __init__(self, argv: list[str], cwd: str, log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
