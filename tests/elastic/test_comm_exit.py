"""A process that exits with its last epoch's group still open leaves no gloo thread to
the finalizing interpreter.

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
    print(counts["before"], counts["open"], tasks(), flush=True)

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
    before, opened, at_exit = (int(x) for x in proc.stdout.split())
    assert opened >= before + 6  # each rank's gloo worker threads and device loop
    assert at_exit <= before, (before, opened, at_exit)
