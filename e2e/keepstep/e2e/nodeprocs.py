"""The pod processes of one process-backed node, and the record the node keeps of each.

Where it sits: `noderunner.NodeRunner` decides with `podstate.decide` what to do about a
pod and carries it out here: `start` turns `podproc.process_spec(pod)` into a process,
`signal` and the whole-node `hang`/`resume`/`kill_all`/`terminate_all` signal process
groups, `reap` notices exits. Nothing here talks to the API server. Thread-safe: the
node's threads and the test calling a fault share one lock.

Every pod process gets its own session, so its process group holds it and every child it
starts (a keepstep agent and its workers): SIGTERM on deletion, SIGKILL for a crash and
SIGSTOP/SIGCONT for a hang reach all of them. A group is only signalled while its leader
is unreaped, because an unreaped leader keeps its PID, and so the group id, reserved.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keepstep.e2e.podproc import (
    PodSpecError,
    ProcessSpec,
    exit_code,
    exit_reason,
    process_spec,
    secret_volumes,
)
from keepstep.e2e.podstate import LOST_EXIT_CODE, LocalPod, Termination

log = logging.getLogger(__name__)

Popen = subprocess.Popen[bytes]
NEVER_RAN = 128  # the kubelet's exit code for a container that could not start
# (namespace, Secret name) -> its data, None if there is no such Secret.
SecretReader = Callable[[str, str], "dict[str, bytes] | None"]


class NodeProcesses:
    """uid -> LocalPod and its process, for the pods one node took on."""

    def __init__(
        self,
        ip: str,
        work_dir: Path,
        env: Mapping[str, str],
        cwd: Path,
        read_secret: SecretReader | None = None,
    ) -> None:
        self.ip = ip
        self.work_dir = work_dir
        self._read_secret = read_secret
        self._env = dict(env)
        self._cwd = cwd
        self._lock = threading.RLock()
        self._locals: dict[str, LocalPod] = {}
        self._popens: dict[str, Popen] = {}
        self._hung = False
        self._closed = False  # stopping or killed: nothing starts any more

    def reset(self) -> None:
        """Forget everything (a node reboot); only after kill_all or terminate_all."""
        with self._lock:
            self._locals.clear()
            self._popens.clear()
            self._hung = self._closed = False

    @property
    def can_start(self) -> bool:
        with self._lock:
            return not (self._hung or self._closed)

    def snapshot(self) -> dict[str, LocalPod]:
        with self._lock:
            return dict(self._locals)

    def get(self, uid: str) -> LocalPod | None:
        with self._lock:
            return self._locals.get(uid)

    def pids(self) -> dict[str, int]:
        """ "namespace/name" -> PID of every pod process that runs now."""
        with self._lock:
            return {
                f"{p.namespace}/{p.name}": p.pid
                for p in self._locals.values()
                if p.running and p.pid is not None
            }

    def start(self, uid: str, pod: Mapping[str, Any]) -> LocalPod:
        """Run the pod's first container (again); a spec the node cannot run, or a program
        that cannot be executed, ends the run at once with the kubelet's reason."""
        meta, wall = pod["metadata"], datetime.now(UTC)
        with self._lock:
            local = self._locals.get(uid) or LocalPod(uid, meta["namespace"], meta["name"], wall)
            volumes = self._secret_volumes(pod)
            if volumes is None:
                return local  # as the kubelet: wait (not taken on) until the Secret exists
            try:
                spec = process_spec(pod, self.ip, self._env, volumes)
            except PodSpecError as err:
                end = Termination(
                    NEVER_RAN,
                    "CreateContainerConfigError",
                    wall,
                    time.monotonic(),
                    message=str(err),
                )
                self._locals[uid] = local.with_end(end, retry=False)
                return self._locals[uid]
            if self._hung or self._closed:
                return local  # hang(), kill() or stop() came in between
            try:
                popen = spawn(spec, self.work_dir, self._cwd)
            except OSError as err:
                end = Termination(
                    NEVER_RAN,
                    "StartError",
                    wall,
                    time.monotonic(),
                    message=f"cannot run {spec.argv[0]!r}: {err}",
                )
                self._locals[uid] = local.with_end(end)
                return self._locals[uid]
            self._popens[uid] = popen
            self._locals[uid] = local.with_start(popen.pid, wall)
            return self._locals[uid]

    def _secret_volumes(self, pod: Mapping[str, Any]) -> dict[str, Path] | None:
        """Write the pod's secret volumes into folders of this node; None while a Secret
        is missing (or cannot be read)."""
        wanted = secret_volumes(pod)
        if not wanted:
            return {}
        meta = pod["metadata"]
        base = self.work_dir / "volumes" / f"{meta['namespace']}_{meta['name']}"
        out = {}
        for volume, secret in wanted.items():
            data = None
            if self._read_secret is not None:
                try:
                    data = self._read_secret(meta["namespace"], secret)
                except Exception as err:  # the API server's client raises its own kinds
                    log.warning("secret %s/%s unreadable: %s", meta["namespace"], secret, err)
            if data is None:
                return None
            folder = base / volume
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            for key, value in data.items():
                if "/" in key or key.startswith("."):
                    continue  # a Secret key is a file name, never a path
                fd = os.open(folder / key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
            out[volume] = folder
        return out

    def mark_lost(self, uid: str, pod: Mapping[str, Any]) -> None:
        """The API says this pod ran here, but no process of ours runs it (a reboot)."""
        meta, wall = pod["metadata"], datetime.now(UTC)
        gone = "the node restarted; the process of this container is gone"
        end = Termination(
            LOST_EXIT_CODE, "ContainerStatusUnknown", wall, time.monotonic(), message=gone
        )
        with self._lock:
            self._locals[uid] = LocalPod(uid, meta["namespace"], meta["name"], wall).with_end(end)

    def signal(self, uid: str, sig: signal.Signals, now: float) -> None:
        """Signal the pod's process group and note it (SIGTERM starts the grace period)."""
        with self._lock:
            local, popen = self._locals.get(uid), self._popens.get(uid)
            if local is None or popen is None:
                return
            signal_group(popen, sig)
            if sig is signal.SIGTERM:
                self._locals[uid] = replace(local, term_sent_at=now)
            elif sig is signal.SIGKILL:
                self._locals[uid] = replace(local, kill_sent=True)

    def forget(self, uid: str) -> None:
        with self._lock:
            self._locals.pop(uid, None)
            self._popens.pop(uid, None)

    def reap(self, now: float) -> list[LocalPod]:
        """Record the exit of every process that ended; returns the pods that just ended."""
        wall, ended = datetime.now(UTC), []
        with self._lock:
            for uid, popen in self._popens.items():
                local = self._locals.get(uid)
                if local is None or not local.running or popen.poll() is None:
                    continue
                code = exit_code(popen.returncode)
                end = Termination(code, exit_reason(code), wall, now, local.started_at)
                self._locals[uid] = local.with_end(end)
                ended.append(self._locals[uid])
        return ended

    def hang(self) -> None:
        with self._lock:
            self._hung = True
            for popen in self._popens.values():
                signal_group(popen, signal.SIGSTOP)

    def resume(self) -> None:
        with self._lock:
            self._hung = False
            for popen in self._popens.values():
                signal_group(popen, signal.SIGCONT)

    def kill_all(self, timeout: float = 10.0) -> None:
        """A crash: nothing starts any more, every group gets SIGKILL, all are reaped."""
        with self._lock:
            self._closed = True
            popens = list(self._popens.values())
            for popen in popens:
                signal_group(popen, signal.SIGKILL)
        _wait(popens, timeout)
        # The reconcile thread that normally records exits is halted by a kill.
        self.reap(time.monotonic())

    def terminate_all(self, timeout: float) -> None:
        """A clean stop: nothing starts any more; SIGTERM every group (SIGCONT first, a
        stopped process cannot exit), SIGKILL what is left after `timeout`; all reaped."""
        with self._lock:
            self._closed, self._hung = True, False
            popens = list(self._popens.values())
            for popen in popens:
                signal_group(popen, signal.SIGCONT)
                signal_group(popen, signal.SIGTERM)
        _wait(popens, timeout)
        with self._lock:
            for popen in popens:
                signal_group(popen, signal.SIGKILL)
        _wait(popens, 10.0)


def spawn(spec: ProcessSpec, work_dir: Path, cwd: Path) -> Popen:
    """Start `spec` in its own session; stdout and stderr append to its log in `work_dir`.
    Raises OSError when the program cannot be executed (not found, not executable)."""
    log = spec.log_path(work_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(spec.argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=spec.env_dict(),  # Popen looks the program up on this environment's PATH
            cwd=cwd,
            start_new_session=True,
        )


def signal_group(popen: Popen, sig: signal.Signals) -> bool:
    """Send `sig` to the process group of `popen`; False if there was none to signal."""
    if popen.returncode is not None:
        return False  # reaped: the group id may belong to somebody else by now
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def proc_state(pid: int) -> str | None:
    """The state letter of `pid` in /proc (R, S, T, Z, ...), or None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the state follows the last ')'.
    return raw[raw.rfind(")") + 2 :].split()[0]


def _wait(popens: list[Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for popen in popens:
        try:
            popen.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            pass  # the caller escalates, or gives up
