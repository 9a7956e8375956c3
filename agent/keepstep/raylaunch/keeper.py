"""The keeper: ties a node's agent and its workers to the life of the node's Ray actor.

Where it sits: `actor.NodeActor` starts `python -m keepstep.raylaunch.keeper --watch FD
--status PATH [--shm-prefix P] -- ARGV...` in a new session (its own process group) and
keeps the write end of a pipe whose read end is FD. The keeper forks once and the first
process exits: Ray ends the direct children of an actor's process when the actor dies,
and the keeper must outlive it to act. The keeper then starts ARGV (the node agent) in
the same process group; the agent's workers join it too, as under `keepstep run`. When
the actor process dies in any way (`ray.kill`, SIGKILL, its Ray node removed), the pipe
reads EOF and the keeper removes the node's shared-memory snapshots and SIGKILLs the
whole group, itself included: a node whose actor is gone has no process left, as after
`kill-node`.

A SIGTERM to the keeper is passed to the agent (it leaves at the next step boundary).
Its pid is in PATH.pid before the first process exits; when the agent exits the keeper
writes its status (the exit code, or minus the signal) to PATH and ends; the actor reads
both there (the keeper is not its child).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

SHM_DIR = Path("/dev/shm")
SIGNAL_SLICE_S = 0.2  # how soon a signal the watch thread caught is passed on


def remove_snapshots(prefix: str) -> None:
    """Unlink this node's shared-memory files (`prefix`: keepstep-<job>-<node>-)."""
    if not prefix:
        return
    for path in SHM_DIR.glob(f"{prefix}*"):
        path.unlink(missing_ok=True)


def _watch(fd: int, shm_prefix: str) -> None:
    """Block until the actor's end of the pipe closes, then end the whole group."""
    try:
        while os.read(fd, 1024):
            pass
    except OSError:
        pass
    remove_snapshots(shm_prefix)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keepstep.raylaunch.keeper")
    parser.add_argument("--watch", type=int, required=True, metavar="FD")
    parser.add_argument("--status", required=True, metavar="PATH")
    parser.add_argument("--shm-prefix", default="", metavar="PREFIX")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    status = Path(args.status)
    keeper = os.fork()
    if keeper != 0:  # the actor's direct child: name the keeper and end
        status.with_suffix(".pid").write_text(str(keeper))
        os._exit(0)
    threading.Thread(target=_watch, args=(args.watch, args.shm_prefix), daemon=True).start()
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    child = subprocess.Popen(command)  # same process group; the pipe is not inherited
    children.append(child)
    code = _wait(child)
    status.with_suffix(".tmp").write_text(str(code))
    status.with_suffix(".tmp").replace(status)  # whole or absent
    return 0


def _wait(child: subprocess.Popen[bytes]) -> int:
    """The child's exit code, waited for in slices: Python runs a signal handler only on
    the main thread when it runs, and the kernel may hand the signal to the watch thread."""
    while True:
        try:
            return child.wait(timeout=SIGNAL_SLICE_S)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    sys.exit(main())
