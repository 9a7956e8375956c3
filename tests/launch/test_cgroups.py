"""The cgroups of slow-node and freezer faults (the launcher and the chaos harness) are
removed whatever happened to the processes inside them.

Real cgroups on real processes (no training job): a stand-in node is a process group that
keeps starting children (as an agent restarts workers). Skipped, with the reason, where
this machine offers no writable cpu cgroup (v1 `cpu` hierarchy or v2 `cpu.max`); the
bounded retry and the name check run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keepstep.chaos.actions import Throttled, send
from keepstep.chaos.inject import Injector
from keepstep.chaos.model import Fault, FaultKind, Trigger
from keepstep.chaos.rundir import alive, process_group
from keepstep.launch import cgroups

_WHY = cgroups.available("cpu")
needs_cpu = pytest.mark.skipif(
    _WHY is not None, reason=f"no writable cpu cgroup (v1 or v2) on this machine: {_WHY}"
)


_VERSION = 1 if (cgroups.ROOT / "cpu" / "cgroup.procs").exists() else 2


def _name(tag: str) -> str:
    return f"{cgroups.PREFIX}test-{os.getpid()}-{tag}"


def _cgroup_of(pid: int, version: int) -> str:
    """The path of `pid`'s group in the cpu hierarchy (v1) or the unified one (v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == 1 and "cpu" in controllers.split(",")) or (
            version == 2 and controllers == ""
        ):
            return path
    raise AssertionError(f"process {pid} is in no cpu cgroup")


def _in(pid: int, group: cgroups.Cgroup) -> bool:
    return Path(_cgroup_of(pid, group.version)).name == group.path.name


def _home(pid: int) -> Path:
    """Where a group made for `pid` goes (and where its processes return)."""
    probe = cgroups.Cgroup.create("cpu", _name("probe"), pid)
    probe.path.rmdir()
    return probe.path.parent


@pytest.fixture
def node() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in node: its own process group, a shell that starts a child every 50 ms."""
    proc = subprocess.Popen(["sh", "-c", "while :; do sleep 0.05; done"], start_new_session=True)
    yield proc
    send(proc.pid, signal.SIGKILL, group=True)
    send(proc.pid, signal.SIGCONT, group=True)
    proc.wait(timeout=10)


@pytest.fixture
def made() -> Iterator[list[cgroups.Cgroup]]:
    """Groups a test made: removed afterwards even if the test failed half way."""
    groups: list[cgroups.Cgroup] = []
    yield groups
    for group in reversed(groups):
        group.release(timeout=5.0)


def _settles(check: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Whether `check` holds within `timeout` s: a node that forks every 50 ms can start or
    reap a child between two reads of its processes."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _throttle(node: int, tag: str, made: list[cgroups.Cgroup]) -> cgroups.Cgroup:
    """What the injector's slow-node fault does."""
    group = cgroups.Cgroup.create("cpu", _name(tag), node)
    made.append(group)
    group.limit_cpu(0.3)
    group.add(process_group(node))
    return group


@needs_cpu
def test_a_second_throttle_of_a_slowed_node_is_a_sibling_not_a_child(
    node: subprocess.Popen[bytes], made: list[cgroups.Cgroup]
) -> None:
    """The random-100 leak: slow-node A, then B on the same node before A ended, A ends
    first. B used to be made inside A, so A could not be removed (EBUSY) and B's end put
    the node back into A, which then outlived the run."""
    before = _cgroup_of(node.pid, _VERSION)
    home = _home(node.pid)
    a = _throttle(node.pid, "a", made)
    b = _throttle(node.pid, "b", made)
    assert a.path.parent == b.path.parent == home
    assert _in(node.pid, b)
    Throttled(a).end()
    assert not a.path.exists() and _in(node.pid, b)  # B still lasts
    Throttled(b).end()
    assert not b.path.exists()
    assert _cgroup_of(node.pid, _VERSION) == before
    assert not any(p.name.startswith(_name("")) for p in home.iterdir() if p.is_dir())


@needs_cpu
def test_when_the_later_throttle_ends_first_the_node_goes_back_to_the_earlier_one(
    node: subprocess.Popen[bytes], made: list[cgroups.Cgroup]
) -> None:
    a = _throttle(node.pid, "a", made)
    b = _throttle(node.pid, "b", made)
    Throttled(b).end()
    assert not b.path.exists()
    assert _settles(lambda: sorted(a.pids()) == sorted(process_group(node.pid)) != [])  # A lasts
    Throttled(a).end()
    assert not a.path.exists() and alive(node.pid)


@needs_cpu
def test_a_throttled_node_killed_meanwhile_leaves_no_group(
    node: subprocess.Popen[bytes], made: list[cgroups.Cgroup]
) -> None:
    group = _throttle(node.pid, "killed", made)
    send(node.pid, signal.SIGKILL, group=True)  # a kill-node before the slow-node ended
    group.release(timeout=5.0)
    assert not group.path.exists()


@needs_cpu
def test_a_child_left_inside_after_its_parent_was_killed_is_moved_out(
    node: subprocess.Popen[bytes], made: list[cgroups.Cgroup]
) -> None:
    stray = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        group = _throttle(node.pid, "child", made)
        group.add([stray.pid])
        send(node.pid, signal.SIGKILL)  # the shell only: its current child lives on
        group.release(timeout=5.0)
        assert not group.path.exists()
        assert alive(stray.pid) and not _in(stray.pid, group)
    finally:
        stray.kill()
        stray.wait(timeout=10)


@needs_cpu
def test_a_zombie_in_the_group_does_not_keep_it(made: list[cgroups.Cgroup]) -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        group = _throttle(child.pid, "zombie", made)
        child.kill()
        deadline = time.monotonic() + 5
        while alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{child.pid}").exists()  # not reaped: a zombie
        group.release(timeout=5.0)
        assert not group.path.exists()
    finally:
        child.wait(timeout=10)


@needs_cpu
def test_a_group_found_nested_inside_is_emptied_and_removed_with_it(
    node: subprocess.Popen[bytes], made: list[cgroups.Cgroup]
) -> None:
    outer = _throttle(node.pid, "outer", made)
    inner = cgroups.Cgroup(outer.path / _name("inner"), outer.version, "cpu", outer.path)
    inner.path.mkdir()
    inner.add(process_group(node.pid))
    assert _in(node.pid, inner)
    outer.release(timeout=5.0)
    assert not outer.path.exists() and alive(node.pid)
    assert not _in(node.pid, outer) and not _in(node.pid, inner)
    inner.release()  # its own end comes later: nothing left to do


def test_a_group_that_stays_busy_is_given_up_after_the_timeout(tmp_path: Path) -> None:
    """Bounded: a directory that cannot be removed (here a plain one with a file in it,
    as a cgroup that processes keep being born into) ends in `CgroupBusy` in time."""
    stuck = tmp_path / _name("stuck")
    stuck.mkdir()
    (stuck / "cgroup.procs").write_text("")
    started = time.monotonic()
    with pytest.raises(cgroups.CgroupBusy, match=r"not removed in 0\.3 s") as raised:
        cgroups.Cgroup(stuck, 2, "cpu").release(timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert isinstance(raised.value, OSError)  # callers that catch OSError still do


def test_names_must_mark_the_group_as_the_harness_s() -> None:
    with pytest.raises(ValueError, match="must start with 'keepstep-chaos-'"):
        cgroups.Cgroup.create("cpu", "someone-else", os.getpid())


# -- through the injector ------------------------------------------------------------------


def _injector(tmp_path: Path, pid: int, faults: tuple[tuple[int, Fault], ...]) -> Injector:
    """An injector on a run directory that says node n0 is `pid` and training runs."""
    now = time.time()
    events = [
        {"t": now, "kind": "agent-started", "node": "n0", "pid": pid},
        {"t": now, "kind": "commit", "step": 0, "epoch": 0},
    ]
    (tmp_path / "events-n0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return Injector(tmp_path, None, faults, {}, poll_s=0.02, ip=None)


def _slow(at: float, duration: float) -> Fault:
    return Fault(FaultKind.SLOW_NODE, Trigger(time=at), node=0, duration=duration, method="cgroup")


@needs_cpu
def test_overlapping_slow_node_faults_leave_no_group_at_the_end_of_either(
    node: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """Run 1 of random-100 in small: slow-node n0 for 1 s, again 0.5 s later for 1 s."""
    injector = _injector(tmp_path, node.pid, ((0, _slow(0.0, 1.0)), (1, _slow(0.5, 1.0))))
    injector.start()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            len(injector.records) < 2 or any(g.path.exists() for g in injector.cgroups)
        ):
            time.sleep(0.05)
        groups = [g.path for g in injector.cgroups]
        left = [str(p) for p in groups if p.exists()]
    finally:
        records = injector.finish()
    assert [(r.skipped, r.detail.get("method")) for r in records] == [(None, "cgroup")] * 2
    assert len(groups) == 2 and groups[0].parent == groups[1].parent
    assert left == []  # each fault's own end removed its group, before the run ended
    assert alive(node.pid) and not any(p.exists() for p in groups)


@needs_cpu
def test_the_end_of_the_run_removes_every_group_made_whatever_became_of_its_fault(
    node: subprocess.Popen[bytes], tmp_path: Path, made: list[cgroups.Cgroup]
) -> None:
    injector = _injector(tmp_path, node.pid, ())
    injector.start()
    # One whose end was lost (its fault's end failed earlier), still holding the node.
    lost = _throttle(node.pid, "lost", made)
    # One a later fault made inside it (as the harness once did).
    nested = cgroups.Cgroup(lost.path / _name("nested"), lost.version, "cpu", lost.path)
    nested.path.mkdir()
    injector.cgroups += [lost, nested]
    injector.finish()
    assert not lost.path.exists() and not nested.path.exists()
    assert alive(node.pid) and not _in(node.pid, lost)
