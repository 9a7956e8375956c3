"""How the agent treats a worker that exits or dies, and how a worker leaves.

- A worker whose finish was recorded is done whatever its exit status: no restart, no
  extra epoch (it used to be restarted after a SIGABRT at interpreter exit).
- A worker killed while its agent's threads run late is not offered to the next epoch,
  and an epoch that names a worker of this node that is not running is ended at once
  (it used to wait for the cold replacement to start).
- A worker that is done releases its store connections, so that a thread still in a
  store call does not abort the process while the interpreter shuts down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv.memory import MemoryKV
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig
from keepstep.agent.node.supervisor import (
    ExitAction,
    Supervisor,
    WorkerSpec,
    after_exit,
    describe_exit,
    dying,
    exiting_in,
)
from keepstep.agent.protocol import EpochRecord
from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.link import socket_address
from keepstep.agent.protocol.messages import Hello, Ok
from keepstep.agent.worker import stores
from keepstep.agent.worker.link_client import LinkClient
from keepstep.elastic.comm import abort_key

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]


# -- the decision ---------------------------------------------------------------------
def decide(code: int, **kw: Any) -> tuple[ExitAction, bool, str]:
    args: dict[str, Any] = {
        "finished": False,
        "in_epoch": True,
        "draining": False,
        "restarts": 0,
        "max_restarts": 3,
    }
    args.update(kw)
    d = after_exit("n1/0", code, **args)
    return d.action, d.abort, d.reason


def test_a_finished_worker_is_done_whatever_its_exit_status() -> None:
    assert decide(0, finished=True) == (ExitAction.DONE, False, "n1/0 finished")
    action, abort, reason = decide(-signal.SIGABRT, finished=True, restarts=3)
    assert (action, abort) == (ExitAction.DONE, False)
    assert reason == "n1/0 finished, then exited with signal SIGABRT"


def test_a_crash_aborts_the_epoch_and_restarts_until_the_limit() -> None:
    assert decide(-9) == (
        ExitAction.RESTART,
        True,
        "n1/0 exited with signal SIGKILL: restart 1 of 3",
    )
    assert decide(1, in_epoch=False)[:2] == (ExitAction.RESTART, False)
    assert decide(1, restarts=3) == (
        ExitAction.GIVE_UP,
        True,
        "n1/0 exited with code 1 after 3 restarts in a row",
    )
    assert decide(-9, draining=True)[0] is ExitAction.GIVE_UP
    assert decide(0) == (ExitAction.DONE, False, "n1/0 left the job")
    assert describe_exit(-200) == "signal 200"


def test_an_error_no_restart_mends_gives_up_at_once() -> None:
    assert decide(1, refused="ConfigError: global_batch=48") == (
        ExitAction.GIVE_UP,
        True,
        "n1/0 exited with code 1 on ConfigError: global_batch=48",
    )


# -- a kill the agent learns of late ----------------------------------------------------
class LateWatch(subprocess.Popen[bytes]):
    """A worker whose watcher thread learns of its exit only when released: as on a
    loaded agent whose watcher cannot run yet (nothing reaps the process meanwhile)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.release = threading.Event()  # its own: a second run starts held back too
        super().__init__(argv, env=env)

    def wait(self, timeout: float | None = None) -> int:
        self.release.wait(30)
        return super().wait(timeout)


def test_alive_is_false_at_once_after_a_kill_even_before_the_watcher_ran(
    tmp_path: Path,
) -> None:
    exits: list[tuple[str, int]] = []
    sup = Supervisor(lambda member, pid, code: exits.append((member, code)))
    spec = WorkerSpec("n0/0", ["sleep", "60"], dict(os.environ), tmp_path / "w.log")
    worker = LateWatch(list(spec.argv), dict(spec.env))
    pid = sup.start(spec, worker)
    try:
        assert sup.alive("n0/0")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while sup.alive("n0/0") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert exits == []  # the watcher has not heard of the kill ...
        assert not sup.alive("n0/0")  # ... and the kernel's answer says it is gone
    finally:
        worker.release.set()
    deadline = time.monotonic() + 10.0
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [("n0/0", -signal.SIGKILL)]


STAT = "4242 (python -m a (b)) S 1 4242 4242 0 -1 {flags} 0 0 0 0 2 1 0 0 20 0 9 0 1"
STATUS = "Name:\tpython\nState:\tS (sleeping)\nSigPnd:\t{own}\nShdPnd:\t{shared}\n"


def test_a_worker_exiting_or_with_a_kill_pending_is_not_alive() -> None:
    # Between a SIGKILL and the zombie, a process with many threads tears down for a
    # while; /proc says so before waitid does.
    quiet = STATUS.format(own="0" * 16, shared="0" * 16)
    assert not exiting_in(STAT.format(flags=0x400100), quiet)
    assert exiting_in(STAT.format(flags=0x400104), quiet)  # PF_EXITING
    pending = STATUS.format(own="0" * 16, shared="0000000000000100")  # bit 9: SIGKILL
    assert exiting_in(STAT.format(flags=0x400100), pending)
    term = STATUS.format(own="0000000000004000", shared="0" * 16)  # SIGTERM: handled, maybe
    assert not exiting_in(STAT.format(flags=0x400100), term)
    assert not exiting_in("garbage", "")
    assert not dying(os.getpid()) and not dying(2**22 + 7)  # this process; no such process


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[NodeAgent, MemoryKV]]:
    kv = MemoryKV()
    cfg = AgentConfig(
        job=f"exits-{os.getpid()}-{time.monotonic_ns()}",
        node="n0",
        etcd="",
        script="",
        command=("sleep", "60"),  # workers that never say hello: still starting, cold
        nproc=2,
        run_dir=tmp_path,
        snapshot_dir=tmp_path,
    )
    node = NodeAgent(cfg, kv)
    node.start()
    try:
        yield node, kv
    finally:
        node.close()


def test_an_epoch_naming_a_worker_that_is_not_ready_here_is_ended_at_once(
    agent: tuple[NodeAgent, MemoryKV],
) -> None:
    node, kv = agent
    job, address = node.cfg.job, node.store_host.address
    link = LinkClient(socket_address(job, "n0"), lambda message: None, 5.0)
    try:
        # n0/1 is ready; n0/0 is not (yet)
        assert link.request(Hello("n0/1"), 5.0) == Ok()
        store = stores.connect(address, 5.0)

        def agree(epoch: int, members: list[str], start_step: int) -> None:
            record = EpochRecord(epoch, members, start_step=start_step, store=address)
            kv.put(protocol.key(job, "epoch"), protocol.encode(record), 5.0)

        # Epoch 1 trained steps before epoch 2 replaced it (one replaced at the step it
        # started at is ended anyway: test_boundary_retry.py).
        agree(1, ["n0/1", "n1/0"], 0)
        agree(2, ["n0/0", "n0/1", "n1/0"], 3)
        deadline = time.monotonic() + 5.0
        while not store.check([abort_key(2)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.get(abort_key(2)).decode() == "epoch 2 names n0/0, not running on n0"
        assert not store.check([abort_key(1)])  # its only worker here is ready
    finally:
        link.close()


@pytest.mark.slow
def test_a_killed_worker_of_a_late_agent_is_not_waited_for(tmp_path: Path) -> None:
    # The agents' threads that learn of a worker's exit, and of a new epoch, run late
    # (starved_agent/sitecustomize.py), as on a loaded machine. The survivors' probe used
    # to find the killed worker "ready": the next epoch kept it ("lost nothing") and the
    # survivors waited in its rendezvous until the cold replacement had started.
    env = {
        **os.environ,
        "PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{HERE / 'starved_agent'}",
        "KEEPSTEP_TEST_STARVE_S": "0.3",
        "KEEPSTEP_TEST_EPOCH_DELAY_S": "0.6",
    }
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            *keepstep_run(run_dir, steps=60),
            "--fault",
            "kill-worker:1@step=15",
            str(HERE.parents[2] / "examples" / "mlp.py"),
            "--sleep",
            "0.05",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    agreed = [e for e in read(run_dir) if e["kind"] == "epoch-agreed" and e["epoch"] > 0]
    after_kill = agreed[0]
    assert "n1/0" not in after_kill["members"], after_kill
    assert after_kill["removed"] == ["n1/0"] and after_kill["admitted"] == []
    summary = load_summary(run_dir)
    kill = summary["recoveries"][0]
    assert kill["cause"] == "kill-worker" and kill["node"] == "n1"
    # A cold replacement takes seconds to start; without waiting for it the survivors
    # commit again within the emulated delays.
    assert kill["mttr_s"] < 2.0, kill
    # The replacement is admitted again if it is ready before the job ends (its cold start
    # takes seconds more on a loaded machine).
    later = [(r["cause"], r["node"]) for r in summary["recoveries"][1:]]
    assert later in ([], [("rejoin", "n1")]), later


# -- a worker that is done ------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("release", "code"), [(False, -signal.SIGABRT), (True, 0)])
def test_releasing_store_connections_lets_a_done_worker_exit_cleanly(
    release: bool, code: int
) -> None:
    # A rendezvous given up (a member never came) leaves a thread in a store call; the
    # store's node exits while this process shuts down. Without the release the thread
    # wakes in a finalizing interpreter and the process dies of SIGABRT (the finding);
    # this also checks that the scenario still reproduces it.
    mode = "release" if release else "keep"
    proc = subprocess.run(
        [sys.executable, str(TESTS / "store_exit_job.py"), "worker", mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr[-3000:]
    if release:
        # At least the job's own connection and the one the blocked rendezvous holds (the
        # abort watch's close theirs as they end).
        released = int(proc.stdout.split("released ")[1].split()[0])
        assert released >= 2, proc.stdout


@pytest.mark.slow
def test_a_worker_that_dies_after_its_finish_is_not_restarted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_two_nodes(run_dir, "abort_after_finish.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read(run_dir)
    first_finish = min(e["t"] for e in events if e["kind"] == "finish")
    started = [e for e in events if e["kind"] == "worker-started" and e["t"] > first_finish]
    assert started == []
    abnormal = sorted(
        (e["member"], e["exit"]) for e in events if e["kind"] == "worker-abnormal-exit"
    )
    assert abnormal == [("n0/0", "signal SIGABRT"), ("n1/0", "signal SIGABRT")]
    assert not [e for e in events if e["kind"] == "fault-detected"]
    summary = load_summary(run_dir)
    assert summary["recoveries"] == [] and summary["steps"] == 12


def test_a_script_keepstep_refuses_ends_the_job_without_restarts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_two_nodes(run_dir, "refused_settings.py")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    said = "exited with code 1 on ConfigError: the script passes global_batch=48 but the"
    assert said in out, out
    events = read(run_dir)
    started = sorted(e["member"] for e in events if e["kind"] == "worker-started")
    assert started == ["n0/0", "n1/0"]  # once each: not restarted


# -- helpers --------------------------------------------------------------------------
def keepstep_run(run_dir: Path, steps: int, nodes: int = 3) -> list[str]:
    return [
        sys.executable,
        "-m",
        "keepstep",
        "run",
        "--nodes",
        str(nodes),
        "--global-batch",
        "24",
        "--micro-batch",
        "4",
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--timeout",
        "100",
    ]


def run_two_nodes(run_dir: Path, script: str) -> subprocess.CompletedProcess[str]:
    """`keepstep run` of one of this folder's scripts on 2 nodes for 12 steps."""
    argv = [*keepstep_run(run_dir, steps=12, nodes=2), str(HERE / script)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=110)


def read(run_dir: Path) -> list[dict[str, Any]]:
    return read_events(run_dir)


def load_summary(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return data


def test_a_connection_opened_after_the_release_began_is_released_too() -> None:
    # On a loaded machine a group build's thread can open its store connection only after
    # the release looked for connections (the CI finding: "released 2", then SIGABRT).
    from torch._C._distributed_c10d import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{host.port}"
    errors: list[Exception] = []

    def late_rendezvous() -> None:
        time.sleep(0.3)  # the release has looked once and is waiting for this thread
        client = stores.connect(address, 60.0)
        try:
            client.wait(["never-set"])  # a member that never comes
        except Exception as err:
            errors.append(err)

    thread = threading.Thread(target=late_rendezvous, name="keepstep-build-7", daemon=True)
    thread.start()
    started = time.monotonic()
    released = stores.release_connections([address], 10.0)
    assert not thread.is_alive(), "the late connection was not released"
    assert released >= 1 and errors, (released, errors)
    assert time.monotonic() - started < 10.0


def test_a_watch_thread_still_connecting_is_released_and_waited_for() -> None:
    # An abort watch's thread connects (a clone of the epoch's store) under the exit
    # guard's count of store calls; on a loaded run the launcher's store held such a clone
    # past the exit guard's wait, and it returned while the interpreter finalized. The
    # release shuts its connection once it appears and waits for the call to end.
    from torch._C._distributed_c10d import TCPStore

    from keepstep.elastic.comm.exit_guard import EXIT_GUARD

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{host.port}"
    errors: list[Exception] = []
    assert EXIT_GUARD.calls.enter()

    def late_watch_call() -> None:
        try:
            time.sleep(0.3)  # the release has looked once: nothing to shut yet
            client = stores.connect(address, 60.0)
            client.wait(["never-set"])  # held up: no answer comes
        except Exception as err:
            errors.append(err)
        finally:
            EXIT_GUARD.calls.leave()

    thread = threading.Thread(target=late_watch_call, name="keepstep-abort-wake-3", daemon=True)
    thread.start()
    started = time.monotonic()
    released = stores.release_connections([address], 10.0)
    thread.join(1.0)
    assert not thread.is_alive(), "the watch thread's call was not released"
    assert released >= 1 and errors, (released, errors)
    assert EXIT_GUARD.calls.busy == 0
    assert time.monotonic() - started < 10.0
