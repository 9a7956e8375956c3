"""`NodeActor`: one per Ray node; it starts that node's agent, reports on it, ends it.

Where it sits: `placement` creates one actor per bundle of the job's placement group
(so one per Ray node) from this plain class; `launcher.RayLauncher` asks it `where` it
runs (the address the node's agent publishes), then `start`s the agent with the
configuration the launcher wrote for it, `poll`s it, and `stop`s it at the end. The agent
runs as `keepstep run` runs it (`python -m keepstep agent --config FILE`), under a
`keeper` that ends the node's whole process group when this actor's process dies, however
it dies. Nothing here decodes bytes from a socket: Ray carries plain strings and ints.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from keepstep.raylaunch.keeper import remove_snapshots

START_TIMEOUT_S = 30.0  # the keeper's first process forks and exits
STOP_GRACE_S = 5.0  # an agent asked to stop (SIGTERM) has this long before SIGKILL


class NodeActor:
    def __init__(self) -> None:
        self._group: int | None = None  # the node's process group (its first process's pid)
        self._status: Path | None = None  # where the keeper writes the agent's status
        self._watch_w: int | None = None
        self._shm_prefix = ""
        self._ended: int | None = None  # the agent's status, once stop() cleaned up after it

    def where(self) -> tuple[str, str]:
        """(the Ray node id, its address) of the node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id(), node_address()

    def start(self, config_json: str, config_path: str, log_path: str) -> int:
        """Write the agent's configuration (`keepstep run`'s JSON) and start the agent under
        a keeper; returns the node's process group id."""
        if self._group is not None:
            raise RuntimeError("this actor already started its agent")
        config = json.loads(config_json)
        self._shm_prefix = f"keepstep-{config['job']}-{config['node']}-"
        Path(config_path).parent.mkdir(parents=True, exist_ok=True)
        Path(config_path).write_text(config_json)
        self._status = Path(tempfile.mkdtemp(prefix="keepstep-ray-")) / "status"
        read_end, self._watch_w = os.pipe()
        os.set_inheritable(read_end, True)
        agent = [sys.executable, "-m", "keepstep", "agent", "--config", config_path]
        keeper = [sys.executable, "-m", "keepstep.raylaunch.keeper", "--watch", str(read_end)]
        keeper += ["--status", str(self._status), "--shm-prefix", self._shm_prefix]
        with open(log_path, "ab") as log:
            first = subprocess.Popen(
                [*keeper, "--", *agent],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(read_end,),
                start_new_session=True,
            )
        os.close(read_end)
        first.wait(timeout=START_TIMEOUT_S)  # it forks the keeper and exits at once
        self._group = first.pid
        return first.pid

    def poll(self) -> int | None:
        """The agent's exit status (negative: the signal), or None while it runs."""
        if self._ended is not None:
            return self._ended
        if self._group is None:
            return None
        if self._status is not None and self._status.exists():
            return self._end(int(self._status.read_text()))
        if _group_alive(self._group):
            return None
        if self._status is not None and self._status.exists():  # written as the group ended
            return self._end(int(self._status.read_text()))
        return self._end(-signal.SIGKILL)  # the group is gone and no status was written

    def _end(self, code: int) -> int:
        """Keep the agent's status and remove the keeper's folder (its status, pid files)."""
        self._ended = code
        if self._status is not None:
            shutil.rmtree(self._status.parent, ignore_errors=True)
        return code

    def stop(self) -> int | None:
        """End the node: SIGTERM to the agent (through its keeper), SIGKILL to what is left
        of its group after STOP_GRACE_S; returns the agent's status."""
        group = self._group
        if group is None:
            return None
        if self.poll() is None:
            keeper = self._keeper_pid()
            if keeper is not None:
                _signal(keeper, signal.SIGTERM, group=False)  # passed on to the agent
            deadline = time.monotonic() + STOP_GRACE_S
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        code = self.poll()
        _signal(group, signal.SIGKILL, group=True)  # workers left behind, if any
        remove_snapshots(self._shm_prefix)
        if self._watch_w is not None:
            os.close(self._watch_w)
            self._watch_w = None
        return self._end(code if code is not None else -signal.SIGKILL)

    def kill_worker(self, pid: int) -> bool:
        """SIGKILL `pid` if it is a live process of this node's group (a worker its agent
        published; a fault); its agent restarts it. Returns whether it was sent."""
        if self._group is None:
            return False
        try:
            if os.getpgid(pid) != self._group:
                return False  # not this node's: the pid was reused, or the record is old
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def crash(self) -> None:
        """Die at once by SIGKILL, as a crashed or OOM-killed actor does (a fault): the
        keeper sees the pipe close and ends the node's processes. Never returns."""
        os.kill(os.getpid(), signal.SIGKILL)

    def _keeper_pid(self) -> int | None:
        pid_file = None if self._status is None else self._status.with_suffix(".pid")
        try:
            return int(pid_file.read_text()) if pid_file is not None else None
        except (OSError, ValueError):
            return None


def node_address() -> str:
    """The address of the Ray node this process runs on (what its peers reach)."""
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, sig: signal.Signals, *, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
