"""Hostile traffic against a running local job: nothing a stranger sends steers it.

A `keepstep run` job of two nodes trains while this test process, which is not one of
the job's workers, sends to every socket the job listens on (each agent's link socket,
process-group store and probe port, found in the run directory and the job's node
records): forged epoch aborts written without the epoch's token and under a guessed one,
a forged `finish`, garbage bytes, an oversized frame with no newline, and a JSON message
that carries a pickle in a field. The job must not notice: no agent crashes, no
recovery happens, each link refuses the stranger, no agent grows by the oversized frames,
and the job ends with the parameters of a fault-free run.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent import protocol
from keepstep.agent.kv import KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.agent.protocol import NodeRecord
from keepstep.agent.protocol.events import read_events
from keepstep.agent.protocol.link import native_address, socket_address
from keepstep.agent.worker import stores
from keepstep.elastic.comm import abort_epoch, abort_key, wake_key
from keepstep.launch.local import LocalRun, agreed_sha, run_local

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "examples" / "mlp.py")
STEPS, GB, MB, SEED = 40, 16, 4, 3
BIG = 32 << 20  # an oversized frame: no newline, far over the link's 1 MiB bound
T = 5.0
# The nodes' etcd lease (`--hang-timeout`). What this test sends reaches no lease, but two
# test sessions on two cores can starve an etcd for a second, which expires a 1 s lease:
# a recovery caused by the load, that this test would take for one the stranger caused.
HANG_TIMEOUT = 3


def lease_lines(run_dir: Path) -> list[str]:
    """The agents' log lines about leases, keepalives and lost nodes."""
    words = ("lease", "keepalive", "lost", "abort")
    return [
        f"{log.name}: {line}"
        for log in sorted(run_dir.glob("agent-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if any(w in line.lower() for w in words)
    ][-40:]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def send(target: Any, data: bytes) -> str:
    """Connect (a Unix address "@..." or (host, port)), send, and say how it ended."""
    family = socket.AF_UNIX if isinstance(target, str) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(T)
            sock.connect(native_address(target) if isinstance(target, str) else target)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            return "answered" if sock.recv(1 << 16) else "closed"
    except TimeoutError:
        return "silent"
    except OSError:  # EPIPE, ECONNRESET, ENOTCONN: it hung up while we were still sending
        return "closed"


class _Touch:
    """Unpickling this would create a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (self.path,))


def wait_for_training(run_dir: Path, proc: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the test could send anything"
        events = read_events(run_dir)
        steps = {e["step"] for e in events if e["kind"] == "commit"}
        if len(steps) >= 2:
            return events
        time.sleep(0.1)
    raise AssertionError("the job did not start training")


def test_strangers_cannot_steer_a_running_job(tmp_path: Path) -> None:
    reference = agreed_sha(
        run_local(
            LocalRun(
                script=MLP, steps=STEPS, global_batch=GB, micro_batch=MB, schedule=[["m0"]],
                seed=SEED,
            ),
            tmp_path / "reference",
        )
    )  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "keepstep", "run", "--nodes", "2", "--global-batch", str(GB),
        "--micro-batch", str(MB), "--steps", str(STEPS), "--seed", str(SEED),
        "--run-dir", str(run_dir), "--timeout", "150", "--hang-timeout", str(HANG_TIMEOUT),
        MLP, "--sleep", "0.1",
    ]  # fmt: skip
    with open(tmp_path / "run.log", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        events = wait_for_training(run_dir, proc)
        started = {e["node"]: e for e in events if e["kind"] == "agent-started"}
        assert sorted(started) == ["n0", "n1"]
        config = json.loads((run_dir / "agent-n0.json").read_text())
        job = config["job"]
        # A stranger on the machine reaches the etcd port but gets no answer without a
        # certificate from the run's CA; the test reads the records as the job itself.
        stranger = EtcdKV(config["etcd"], timeout=2.0)
        try:
            with pytest.raises(KVError):
                stranger.get_prefix(protocol.prefix(job, "nodes"), 2.0)
        finally:
            stranger.close()
        kv = EtcdKV(config["etcd"], credentials=EtcdCredentials.from_dir(config["etcd_tls"]))
        try:
            nodes = {
                item.key.rpartition("/")[2]: protocol.decode(NodeRecord, item.value)
                for item in kv.get_prefix(protocol.prefix(job, "nodes"), T)
            }
        finally:
            kv.close()
        pids = {node: int(e["pid"]) for node, e in started.items()}
        before = {node: rss_kib(pid) for node, pid in pids.items()}
        marker = tmp_path / "unpickled"
        pickled = base64.b64encode(pickle.dumps(_Touch(str(marker)))).decode()
        finish = {"op": "finish", "member": "n0/0", "done": STEPS, "params_sha256": "0" * 64}
        with_pickle = {"op": "hello", "member": "n0/0", "state": pickled}
        frames = {
            "finish": json.dumps({**finish, "id": 1}).encode() + b"\n",
            "pickle": json.dumps({**with_pickle, "id": 2}).encode() + b"\n",
            "garbage": os.urandom(4096),
            "oversized": b"x" * BIG,
        }
        for node, record in nodes.items():
            store = str(started[node]["store"])
            host, port = stores.parse_address(store)
            targets: dict[str, Any] = {
                "link": socket_address(job, node),
                "store": (host, port),
                "probe": (record.host, record.probe_port),
            }
            for where, target in targets.items():
                for what, data in frames.items():
                    ended = send(target, data)
                    if where == "link":  # refused before a byte is read
                        assert ended == "closed", (node, what, ended)
            # Forged aborts of the first epochs, on a store connection of our own.
            client = stores.connect(store, T)
            guessed = stores.for_epoch(client, "0" * 32)
            for epoch in range(4):
                abort_epoch(client, epoch, "forged", 2)
                abort_epoch(guessed, epoch, "forged under a guessed token", 2)
                client.set(abort_key(epoch), "forged")
                client.multi_set([wake_key(epoch, r) for r in range(2)], ["wake"] * 2)
        for node, pid in pids.items():
            assert Path(f"/proc/{pid}").exists(), f"agent {node} died"
            grown = rss_kib(pid) - before[node]
            assert grown < (BIG >> 10) // 2, f"agent {node} grew by {grown} KiB"
        assert proc.poll() is None, "the run ended while under attack"
        assert proc.wait(timeout=150) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failures"] == [] and summary["agent_exit_codes"] == {"n0": 0, "n1": 0}
    # No epoch after the first (what the agents logged of leases and losses, if there was).
    assert summary["recoveries"] == [], (summary["recoveries"], lease_lines(run_dir))
    assert summary["world_size_by_step"] == [2] * STEPS
    assert summary["params_sha256"] == reference
    assert not marker.exists()
    for node in pids:
        log = (run_dir / f"agent-{node}.log").read_text()
        assert "refused a connection" in log, log[-2000:]
