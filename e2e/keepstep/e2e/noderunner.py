"""A process-backed Kubernetes node: the pods the scheduler binds to it run as local processes.

Where it sits: end-to-end tests and `e2e/cluster up` start one `NodeRunner` per node (in
process, or as `python -m keepstep.e2e.noderunner --kubeconfig PATH --name NODE --ip
127.0.X.Y --work-dir DIR`). Its API calls go through `nodeapi.NodeApi`, its processes
live in `nodeprocs.NodeProcesses`. Three threads:

    heartbeat  renews the Lease in kube-node-lease every heartbeat_s and applies the Ready
               condition every status_every_s, so the node lifecycle controller keeps it Ready
    watch      `podwatch.PodWatch`: the pods with spec.nodeName == NODE, in a local cache
    reconcile  on every pod event and every 0.25 s: reaps exited processes, asks
               `podstate.decide` what to do per pod, does it, and applies the pod status
               `podstatus.desired_status` computes when the API server's copy differs

Whole-node faults for chaos tests: `kill()` (a crash: every pod process group gets SIGKILL,
nothing more is said to the API server, so the Node goes NotReady after the controller's
grace period), `hang()`/`resume()` (SIGSTOP/SIGCONT of every pod process group; no new
pods start meanwhile), `cut_off()`/`reconnect()` (no API traffic, pods keep running).
`stop()` is a clean shutdown: pods get SIGTERM (then SIGKILL), their final status is
reported, and the Node and its Lease are deleted so nothing is scheduled onto it again.
The CLI maps SIGTERM/SIGINT to stop() and SIGUSR1 to kill().
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from keepstep.e2e.nodeapi import NodeApi
from keepstep.e2e.nodeobj import NodeConfig, lease_body, node_body, node_status_body
from keepstep.e2e.nodeprocs import NodeProcesses
from keepstep.e2e.podproc import pod_key
from keepstep.e2e.podstate import Act, decide
from keepstep.e2e.podstatus import desired_status, differs
from keepstep.e2e.podwatch import PodWatch

log = logging.getLogger(__name__)
POLL_S = 0.25  # how soon an exited process is noticed without any pod event


class NodeRunnerError(RuntimeError):
    """The node could not register with the API server, or was used in the wrong state."""


class NodeRunner:
    """One process-backed node. start() after kill() is a reboot: pods the API server
    says were running here are reported lost (exit code 137)."""

    def __init__(
        self,
        kubeconfig: Path,
        name: str,
        ip: str,
        work_dir: Path,
        *,
        heartbeat_s: float = 2.0,
        status_every_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        taints: Sequence[tuple[str, str, str]] = (),
    ) -> None:
        """`env` (default: this process's environment) is what every pod process starts
        with, under the pod's own env; pods run in `cwd` (default: the current directory).
        `taints` (key, value, effect) keep pods without a matching toleration away."""
        self.config = NodeConfig(
            kubeconfig,
            name,
            ip,
            work_dir,
            heartbeat_s=heartbeat_s,
            status_every_s=status_every_s,
            taints=tuple(taints),
        )
        self.procs = NodeProcesses(
            ip,
            work_dir,
            os.environ if env is None else env,
            cwd or Path.cwd(),
            read_secret=lambda namespace, name: self._require_api().read_secret(namespace, name),
        )
        self._reconciling = threading.Lock()  # one reconcile pass at a time
        self._patched: dict[str, tuple[Any, str]] = {}  # uid -> (status, resourceVersion)
        self._halt = threading.Event()
        self._online = threading.Event()
        self._wake = threading.Event()
        self.pods = PodWatch(name, self._require_api, self._online, self._halt, self._wake.set)
        self._threads: list[threading.Thread] = []
        self._api: NodeApi | None = None
        self._node_uid: str | None = None
        self._ready_since = datetime.now(UTC)
        self._status_due = 0.0

    @property
    def name(self) -> str:
        return self.config.name

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def pids(self) -> dict[str, int]:
        """ "namespace/name" -> PID of every pod process that runs now."""
        return self.procs.pids()

    def start(self, timeout: float = 30.0) -> None:
        """Register the Node (Ready, capacity, address) and its Lease, start the threads.
        Raises NodeRunnerError if the API server did not take the Node within `timeout`."""
        if self.running():
            raise NodeRunnerError(f"node {self.name} is already running")
        self.config.work_dir.mkdir(parents=True, exist_ok=True)
        self.procs.reset()
        self.pods.clear()
        self._patched.clear()
        self._halt.clear()
        api = self._api = NodeApi(self.config.kubeconfig, self.config.request_timeout_s)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._register(api)
                break
            except Exception as err:  # the API server may still be coming up
                if time.monotonic() >= deadline:
                    self._close_api()
                    raise NodeRunnerError(
                        f"node {self.name}: not registered within {timeout} s: {err}"
                    ) from err
                time.sleep(0.5)
        self._online.set()
        self._threads = [
            threading.Thread(target=loop, name=f"{self.name}-{loop.__name__}", daemon=True)
            for loop in (self._heartbeat_loop, self.pods.run, self._reconcile_loop)
        ]
        for thread in self._threads:
            thread.start()
        log.info("node %s registered (ip %s)", self.name, self.config.ip)

    def stop(self, timeout: float = 15.0, *, deregister: bool = True) -> None:
        """A clean shutdown: SIGTERM every pod's process group, SIGKILL what is left after
        `timeout`, report how the pods ended, stop the threads, delete the Node and Lease."""
        if self.running():
            self.procs.terminate_all(timeout)
            if self._online.is_set():
                self._reconcile_once()
            self._halt_threads()
        if deregister and self._node_uid is not None:
            try:  # after kill() too: the fault is over, the test's node must go
                api = self._api or NodeApi(self.config.kubeconfig, self.config.request_timeout_s)
                self._api = api
                api.delete_node(self.name)
                api.delete_lease(self.name)
                self._node_uid = None
            except Exception as err:
                log.warning("node %s: Node and Lease not deleted: %s", self.name, err)
        self._close_api()

    def kill(self) -> None:
        """A node crash: SIGKILL every pod process group and go silent (no status, no
        Lease). The Node object stays; the node lifecycle controller marks it NotReady."""
        self._halt.set()
        self._online.clear()
        self.procs.kill_all()
        self._halt_threads()
        self._close_api()

    def hang(self) -> None:
        """SIGSTOP every pod process group; pods bound meanwhile wait for resume()."""
        self.procs.hang()

    def resume(self) -> None:
        self.procs.resume()
        self._wake.set()

    def cut_off(self) -> None:
        """Stop talking to the API server (no Lease, status or watch); pods keep running."""
        self._online.clear()
        if self._api is not None:
            self._api.interrupt_watch()

    def reconnect(self) -> None:
        """Talk again: Ready turns True now, the pods are listed afresh."""
        self._ready_since = datetime.now(UTC)
        self._status_due = 0.0
        self._online.set()
        self._wake.set()

    # -- the threads -------------------------------------------------------------------

    def _register(self, api: NodeApi) -> None:
        now = datetime.now(UTC)
        self._ready_since = now
        self._node_uid = api.apply_node(node_body(self.config))
        api.apply_node_status(self.name, node_status_body(self.config, now, now))
        api.apply_lease(self.name, lease_body(self.config, now, self._node_uid))
        self._status_due = time.monotonic() + self.config.status_every_s

    def _heartbeat_loop(self) -> None:
        while not self._halt.wait(self.config.heartbeat_s):
            if not self._online.is_set():
                continue
            try:
                api, now = self._require_api(), datetime.now(UTC)
                api.apply_lease(self.name, lease_body(self.config, now, self._node_uid))
                if time.monotonic() >= self._status_due and self._online.is_set():
                    body = node_status_body(self.config, now, self._ready_since)
                    api.apply_node_status(self.name, body)
                    self._status_due = time.monotonic() + self.config.status_every_s
            except Exception as err:
                log.warning("node %s: heartbeat failed: %s", self.name, err)

    def _reconcile_loop(self) -> None:
        while not self._halt.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            if self._halt.is_set():
                return
            try:
                self._reconcile_once()
            except Exception:
                log.exception("node %s: reconcile pass failed", self.name)

    # -- one reconcile pass ---------------------------------------------------------------

    def _reconcile_once(self) -> None:
        """Observe (reap exits, copy the pod cache), decide per pod, act, report status."""
        with self._reconciling:
            now = time.monotonic()
            for ended in self.procs.reap(now):
                end = ended.ended
                log.info(
                    "node %s: %s/%s exited with %s",
                    self.name,
                    ended.namespace,
                    ended.name,
                    end.exit_code if end else "?",
                )
            online = self._online.is_set()
            can_start = online and self.procs.can_start
            pods = self.pods.snapshot()
            locals_ = self.procs.snapshot()
            for uid in sorted(pods.keys() | locals_.keys()):
                pod = pods.get(uid)
                decision = decide(pod, locals_.get(uid), now, can_start=can_start)
                for act in decision.actions:
                    what = pod_key(pod) if pod else uid
                    log.info("node %s: %s %s: %s", self.name, act.value, what, decision.reason)
                    self._act(act, uid, pod, now, online)
                removed = Act.FINALIZE in decision.actions
                if pod is not None and online and not removed and not self._halt.is_set():
                    self._report(uid, pod)

    def _act(
        self, act: Act, uid: str, pod: dict[str, Any] | None, now: float, online: bool
    ) -> None:
        if act is Act.START and pod is not None:
            local = self.procs.start(uid, pod)
            if local.running:
                log.info("node %s: %s runs as pid %s", self.name, pod_key(pod), local.pid)
            elif local.ended is not None:
                log.warning("node %s: %s", self.name, local.ended.message)
        elif act is Act.MARK_LOST and pod is not None:
            self.procs.mark_lost(uid, pod)
        elif act is Act.TERMINATE:
            self.procs.signal(uid, signal.SIGTERM, now)
        elif act is Act.KILL:
            self.procs.signal(uid, signal.SIGKILL, now)
        elif act is Act.FINALIZE and pod is not None and online:
            meta = pod["metadata"]
            try:
                self._require_api().delete_pod(meta["namespace"], meta["name"], uid)
            except Exception as err:  # the next pass tries again
                log.warning("node %s: %s not deleted: %s", self.name, pod_key(pod), err)
        elif act is Act.FORGET:
            self.procs.forget(uid)
            self._patched.pop(uid, None)

    def _report(self, uid: str, pod: dict[str, Any]) -> None:
        """Apply the status the node computes when the API server's copy lacks it."""
        desired = desired_status(pod, self.procs.get(uid), self.config.ip)
        if desired is None or not differs(desired, pod.get("status", {})):
            return
        meta = pod["metadata"]
        if self._patched.get(uid) == (desired, meta.get("resourceVersion", "")):
            return  # written already; the server normalised it, or its answer is in flight
        try:
            updated = self._require_api().apply_pod_status(meta["namespace"], meta["name"], desired)
        except Exception as err:
            log.warning("node %s: status of %s not written: %s", self.name, pod_key(pod), err)
            return
        self._patched[uid] = (desired, updated.get("metadata", {}).get("resourceVersion", ""))
        self.pods.store(updated)

    # -- helpers ---------------------------------------------------------------------------

    def _halt_threads(self) -> None:
        self._halt.set()
        self._wake.set()
        if self._api is not None:
            self._api.interrupt_watch()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(self.config.request_timeout_s + 5.0)
                if thread.is_alive():
                    log.warning("node %s: thread %s did not stop", self.name, thread.name)
        self._threads = []

    def _close_api(self) -> None:
        api, self._api = self._api, None
        if api is not None:
            api.close()

    def _require_api(self) -> NodeApi:
        api = self._api
        if api is None:
            raise NodeRunnerError(f"node {self.name} is not started")
        return api


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keepstep.e2e.noderunner", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--name", required=True, help="the Node's name")
    parser.add_argument("--ip", required=True, help="the node's address, e.g. 127.0.1.1")
    parser.add_argument("--work-dir", type=Path, required=True, help="pod logs go here")
    parser.add_argument("--heartbeat", type=float, default=2.0, help="Lease renewal, seconds")
    parser.add_argument(
        "--taint", action="append", default=[], metavar="KEY=VALUE:EFFECT", help="repeatable"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        taints = [_taint(text) for text in args.taint]
        runner = NodeRunner(
            args.kubeconfig,
            args.name,
            args.ip,
            args.work_dir,
            heartbeat_s=args.heartbeat,
            taints=taints,
        )
        runner.start()
    except (ValueError, NodeRunnerError) as err:
        print(f"noderunner: {err}", file=sys.stderr)
        return 2
    wanted: list[str] = []
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        wanted.append("kill" if signum == signal.SIGUSR1 else "stop")
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    print(f"node {args.name} ready", flush=True)
    while not done.wait(1.0):
        if not runner.running():
            return 1
    if wanted[0] == "kill":
        runner.kill()
    else:
        runner.stop()
    return 0


def _taint(text: str) -> tuple[str, str, str]:
    match = re.fullmatch(r"([^=:]+)(?:=([^:]*))?:(\w+)", text)
    if match is None:
        raise ValueError(f"--taint {text!r} is not KEY[=VALUE]:EFFECT")
    return match[1], match[2] or "", match[3]


if __name__ == "__main__":
    sys.exit(main())
