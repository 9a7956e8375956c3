"""A process that exits with its last epoch's group still open leaves no gloo thread to
the finalizing interpreter, and no thread of the epoch's holds the group's last reference.

gloo's worker thread frees a finished work, and with it the work's tensors, after the
caller saw the work complete; if the interpreter is finalizing by then, the thread dies in
a forced unwind and the process with SIGABRT ("terminate called without an active
exception"): 3 of 40 runs of two ranks that exit right after their last allgather.
The exit guard drops such a group before finalizing (``Reaper.drop_idle``), which joins
its threads: the threads a process has at the very end of its exit are those it had
before the group was made.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref
from datetime import timedelta

import torch
from torch._C._distributed_c10d import HashStore, Store

from keepstep.elastic.comm import Communicator
from keepstep.elastic.comm.group import EpochSpec, GroupBuild
from keepstep.elastic.comm.transport import Backend, Link, Pending
from keepstep.elastic.comm.watch import AbortWatch

SCRIPT = """
import atexit, os, sys, time

def tasks():
    return len(os.listdir("/proc/self/task"))

counts = {}

def last():
    # Registered before keepstep is imported: runs after its exit guard (atexit is LIFO).
    # A watch thread may take a moment to return once its work is done: gloo's threads,
    # if left, never end.
    deadline = time.monotonic() + 2.0
    while tasks() > counts["before"] and time.monotonic() < deadline:
        time.sleep(0.01)
    print("THREADS", counts["before"], counts["open"], tasks(), flush=True)

atexit.register(last)

import threading
import torch
from torch.distributed import HashStore
from keepstep.elastic.comm import Communicator

torch.ones(4) + 1  # torch's own threads, if any, start before the count
counts["before"] = tasks()
store, comms, outs = HashStore(), {}, {}

def rank(me):
    comms[me] = Communicator.create(store, 0, ["a", "b"], me)
    outs[me] = comms[me].allgather(torch.full((4,), float(ord(me))))

other = threading.Thread(target=rank, args=("b",))
other.start()
rank("a")
other.join()
counts["open"] = tasks()
assert [t[0].item() for t in outs["a"]] == [97.0, 98.0], outs
"""


def test_the_last_groups_threads_end_before_the_interpreter_finalizes() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Older torch's gloo writes its own lines to stdout ("[Gloo] Rank 0 is connected ...").
    line = next(x for x in proc.stdout.splitlines() if x.startswith("THREADS "))
    before, opened, at_exit = (int(x) for x in line.split()[1:])
    assert opened >= before + 6  # each rank's gloo worker threads and device loop
    assert at_exit <= before, (before, opened, at_exit)


# A group's destructor waits for the group's threads without the GIL. Run by a daemon
# thread of the epoch's (the abort watch's two, the group's build thread) as it ends, at
# the moment the interpreter finalizes, it kills the process when it takes the GIL back: a
# core of a worker that aborted after its last step showed the watch's reader thread
# dropping its watch, whose abort hook held the link and its group. Those threads keep
# their targets until their very end, so none of them may lead to the link.


def test_the_abort_watch_does_not_keep_the_epochs_link() -> None:
    store, comms = HashStore(), {}

    def rank(me: str) -> None:
        comms[me] = Communicator.create(store, 0, ["a", "b"], me, timeout=timedelta(seconds=20))
        comms[me].allreduce(torch.ones(2))

    other = threading.Thread(target=rank, args=("b",))
    other.start()
    rank("a")
    other.join(timeout=30)
    watches = [comm._watch for comm in comms.values()]  # as their threads hold them
    links = [weakref.ref(comm._link) for comm in comms.values()]
    assert all(link() is not None for link in links)
    comms.clear()  # the script is done with its communicators, without closing them
    assert [link() for link in links] == [None, None]
    # The abort hook outlives its link harmlessly.
    watches[0].fire("given up after the links went")
    assert watches[1].poll(wait=5.0) == "given up after the links went"
    for watch in watches:
        watch.close()


class _Link:
    def interrupt(self) -> None:
        pass

    def retire(self, pending: Pending | None) -> None:
        pass


class _Transport:
    backend = Backend.GLOO
    device = torch.device("cpu")

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        pass

    def connect(self, store: Store, spec: EpochSpec) -> Link:
        return _Link()  # type: ignore[return-value]  # only what GroupBuild touches


def test_the_build_thread_does_not_keep_the_link_it_built() -> None:
    spec = EpochSpec(0, ("a", "b"), "a", timedelta(seconds=20), "127.0.0.1")
    store = HashStore()
    build = GroupBuild(store, spec, _Transport())
    watch = AbortWatch(store, 0, 0, 2)
    try:
        link = weakref.ref(build.result(watch))
    finally:
        watch.close()
    assert link() is None  # the build (and its thread's target) lives on: not the link
    assert build is not None
