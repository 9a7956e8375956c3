"""Send a signal to one thread of another process that is not its main thread.

A signal sent to a process (kill) may be taken by any of its threads that does not block
it; tests that must not depend on the kernel's choice pick the thread themselves with
tgkill(2). Linux only (x86_64 and aarch64 syscall numbers).
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
from pathlib import Path

TGKILL = {"x86_64": 234, "aarch64": 131}


def other_threads(pid: int, sig: signal.Signals) -> list[int]:
    """The thread ids of `pid` other than its main thread that do not block `sig`."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        if tid == pid:
            continue
        try:
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
        except OSError:
            continue  # the thread ended
        if not int(fields["SigBlk"].strip(), 16) & (1 << (sig - 1)):
            found.append(tid)
    return found


def signal_other_thread(pid: int, sig: signal.Signals) -> int:
    """Send `sig` to a thread of `pid` that is not its main thread; returns its id."""
    number = TGKILL.get(platform.machine())
    if number is None:
        raise OSError(f"no tgkill syscall number known for {platform.machine()}")
    threads = other_threads(pid, sig)
    if not threads:
        raise OSError(f"process {pid} has no thread but its main one that takes {sig.name}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, threads[0], int(sig)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return threads[0]
