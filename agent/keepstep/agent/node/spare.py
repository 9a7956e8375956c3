"""Warm spares: a process that has already imported torch, waiting to become a worker.

A fresh training process spends seconds importing torch before it can even ask to be
admitted; while it does, the job trains one worker short. With `warm_spare` on, the agent
keeps one spare per node: when a worker crashes, the spare is handed the worker's command
line and environment over its stdin and runs the script in place (`runpy`), so the
replacement asks for admission almost at once. Only `python SCRIPT ARGS` workers can use
a spare; any other command starts cold.

    python -m keepstep.agent.node.spare     prints "ready" once imported, then waits for one
                                       JSON line {"argv", "env", "log"} and runs it
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("keepstep.agent")

READY = b"ready\n"


class SparePool:
    """At most one warm spare; `take` hands it a worker's command, or returns None."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_path: Path,
        on_ready: Callable[[int], None] = lambda pid: None,
    ) -> None:
        self._env = dict(env)
        self._log_path = log_path
        self._on_ready = on_ready
        self._lock = threading.Lock()
        self._spare: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self._closed = False

    def start(self) -> None:
        """Start a spare in the background (it is ready once it has imported torch)."""
        with self._lock:
            if self._closed or self._spare is not None:
                return
            with open(self._log_path, "ab") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "keepstep.agent.node.spare"],
                    env=self._env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            self._spare, self._ready = proc, threading.Event()
            ready = self._ready
        threading.Thread(
            target=self._await_ready, args=(proc, ready), name="spare-ready", daemon=True
        ).start()

    def _await_ready(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        assert proc.stdout is not None
        try:
            said = proc.stdout.readline()
        except (ValueError, OSError):  # closed: the pool closed meanwhile
            return
        if said == READY:
            ready.set()
            self._on_ready(proc.pid)

    def take(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> subprocess.Popen[bytes] | None:
        """Hand a ready spare the worker's command; None if there is none or it cannot run
        this command (the caller then starts the worker cold). A new spare is started."""
        if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
            return None
        with self._lock:
            proc = self._spare
            if proc is None or not self._ready.is_set() or proc.poll() is not None:
                return None
            self._spare = None
        order = {"argv": list(argv), "env": dict(env), "log": str(log_path)}
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(order).encode() + b"\n")
            proc.stdin.close()
        except OSError as error:  # it died between the check and the write
            log.warning("warm spare %d could not take the worker: %s", proc.pid, error)
            proc.kill()
            proc.wait(timeout=5)
            _close_pipes(proc)
            return None
        assert proc.stdout is not None
        proc.stdout.close()  # it said ready; as the worker it writes to its log
        self.start()
        return proc

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            proc, self._spare = self._spare, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=timeout)
            _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _become(order: dict[str, object]) -> None:
    """Turn this process into the worker `order` describes, then run its script."""
    import runpy

    log_fd = os.open(str(order["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env = order["env"]
    argv = order["argv"]
    assert isinstance(env, dict) and isinstance(argv, list)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    sys.argv = [str(a) for a in argv[1:]]
    sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
    runpy.run_path(sys.argv[0], run_name="__main__")


def main() -> None:
    # The slow part a cold worker pays before it can do anything.
    # torch._dynamo (which imports torch) too: a torch optimizer's first call imports it.
    import torch._dynamo  # noqa: F401

    import keepstep.elastic.api  # noqa: F401  (the library the script will import)
    from keepstep.elastic.reduce_kernels import preload

    preload()  # the exact reduction's compiled loops, a second more on a busy machine
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    # Waits without a timeout on purpose: a spare lives until it is used or the agent,
    # its parent, kills it at close (or dies, closing this pipe: readline returns b"").
    line = sys.stdin.buffer.readline()
    if not line:
        return
    _become(json.loads(line))


if __name__ == "__main__":
    main()
