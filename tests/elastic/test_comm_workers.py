"""Tests of keepstep.elastic.comm with real worker processes: collectives, epochs rebuilt
in the same processes, a SIGKILLed peer, an abort that unblocks everyone.

This file run as a script is the worker (`python test_comm_workers.py SCENARIO PORT
NAME`), so every scenario lives next to its asserts. Workers report one JSON object per
line on stdout, prefixed with `RESULT `. test_comm.py has the in-process tests.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import Store, TCPStore

from keepstep.elastic.comm import Communicator, abort_epoch
from keepstep.elastic.errors import PeerLost

_EPOCHS = {  # rebuild scenario: n2 leaves after epoch 0, n3 joins at epoch 2
    0: ("n0", "n1", "n2"),
    1: ("n0", "n1"),
    2: ("n0", "n1", "n3"),
}
_GROUP_TIMEOUT = timedelta(seconds=30)
# The store is the test's own and never fails here, but two test sessions share two cores:
# a read of it can wait seconds for a core, which the default (2 s) would take for a dead
# store. No scenario here detects a loss through the store.
_STORE_TIMEOUT = timedelta(seconds=20)


def _report(**fields: Any) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def _worker_collectives(store: Store, me: str) -> None:
    comm = Communicator.create(
        store, 0, ["n0", "n1", "n2"], me, timeout=_GROUP_TIMEOUT, store_timeout=_STORE_TIMEOUT
    )
    r = comm.rank
    ints = torch.tensor([r + 1, 2**40 + r, -(2**50)], dtype=torch.int64)
    comm.allreduce(ints, dist.ReduceOp.SUM)
    floats = torch.tensor([r * 1.5, -float(r), 1e300 if r == 1 else 0.0], dtype=torch.float64)
    comm.allreduce(floats, dist.ReduceOp.MAX)
    bcast = torch.full((3,), float(r))
    comm.broadcast(bcast, src=1)
    mine = json.dumps({"me": me, "pad": "x" * (100 * r)}).encode()
    gathered = [json.loads(b) for b in comm.allgather_bytes(mine, 1024)]
    comm.barrier()
    _report(
        me=me,
        ints=ints.tolist(),
        floats=floats.tolist(),
        bcast=bcast.tolist(),
        gathered=gathered,
        build_s=comm.build_seconds,
    )
    comm.close()


def _worker_rebuild(store: Store, me: str) -> None:
    for epoch, members in _EPOCHS.items():
        if me not in members:
            continue
        comm = Communicator.create(
            store, epoch, members, me, timeout=_GROUP_TIMEOUT, store_timeout=_STORE_TIMEOUT
        )
        t = torch.tensor([comm.rank + 1, 10 * (epoch + 1)], dtype=torch.int64)
        comm.allreduce(t)
        names = [b.decode() for b in comm.allgather_bytes(me.encode(), 64)]
        _report(
            me=me,
            epoch=epoch,
            size=comm.size,
            sum=t.tolist(),
            names=names,
            build_s=comm.build_seconds,
        )
        comm.close()


def _worker_blocked(store: Store, me: str, scenario: str) -> None:
    """n0..n2 enter an allreduce that the last member never joins; the test kills or aborts."""
    members = ["n0", "n1", "n2", "n3"] if scenario == "kill" else ["n0", "n1", "n2"]
    # With 90 s, waiting the group timeout out on the way to exit would fail the test.
    timeout = _GROUP_TIMEOUT if scenario == "kill" else timedelta(seconds=90)
    comm = Communicator.create(store, 0, members, me, timeout=timeout, store_timeout=_STORE_TIMEOUT)
    comm.allreduce(torch.ones(4))  # warm: every pair is connected
    store.set(f"entered/{me}", "1")
    if me == members[-1]:
        if scenario == "kill":
            time.sleep(60)  # killed by the test
        deadline = time.monotonic() + 20
        while not comm.aborted() and time.monotonic() < deadline:
            time.sleep(0.01)
        _report(me=me, lost_at=time.time(), reason="", saw_abort=comm.aborted())
    else:
        try:
            comm.allreduce(torch.ones(4))
            _report(me=me, error="allreduce completed")
            return
        except PeerLost as lost:
            _report(me=me, lost_at=time.time(), reason=lost.reason)
    begin = time.perf_counter()
    comm.close()
    close_s = time.perf_counter() - begin
    if scenario == "kill":  # the survivors go on in the same process
        comm = Communicator.create(
            store, 1, ["n0", "n1", "n2"], me, timeout=_GROUP_TIMEOUT, store_timeout=_STORE_TIMEOUT
        )
        t = torch.tensor([comm.rank + 1], dtype=torch.int64)
        comm.allreduce(t)
        _report(me=me, close_s=close_s, next_sum=t.item(), build_s=comm.build_seconds)
        comm.close()
    else:
        _report(me=me, close_s=close_s)


def _worker_main(scenario: str, port: int, me: str) -> None:
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    if scenario == "collectives":
        _worker_collectives(store, me)
    elif scenario == "rebuild":
        _worker_rebuild(store, me)
    else:
        _worker_blocked(store, me, scenario)


class _Workers:
    """Worker processes of one scenario around a TCPStore hosted by the test."""

    def __init__(self, scenario: str, names: Sequence[str]) -> None:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs = {
            name: subprocess.Popen(
                [sys.executable, __file__, scenario, str(self.store.port), name],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in names
        }

    def finish(
        self, timeout_s: float = 60.0, killed: Sequence[str] = ()
    ) -> dict[str, list[dict[str, Any]]]:
        """Every worker's reports, once all exited within `timeout_s`, each with status 0
        (or SIGKILL for those in `killed`)."""
        results: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + timeout_s
        for name, proc in self.procs.items():
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            expected = -signal.SIGKILL if name in killed else 0
            if proc.returncode != expected:
                pytest.fail(f"worker {name} exited {proc.returncode}:\n{err[-3000:]}")
            results[name] = [
                json.loads(line[len("RESULT ") :])
                for line in out.splitlines()
                if line.startswith("RESULT ")
            ]
        return results

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)  # also closes the pipes


@pytest.fixture
def workers() -> Any:
    started: list[_Workers] = []

    def start(scenario: str, names: Sequence[str]) -> _Workers:
        started.append(_Workers(scenario, names))
        return started[-1]

    yield start
    for group in started:
        group.kill_all()


@pytest.mark.slow
def test_three_ranks_collectives(workers: Any) -> None:
    results = workers("collectives", ["n0", "n1", "n2"]).finish()
    for name, (got,) in results.items():
        assert got["me"] == name
        assert got["ints"] == [6, 3 * 2**40 + 3, -3 * 2**50]
        assert got["floats"] == [3.0, 0.0, 1e300]
        assert got["bcast"] == [1.0, 1.0, 1.0]
        assert got["gathered"] == [{"me": f"n{r}", "pad": "x" * (100 * r)} for r in range(3)]


@pytest.mark.slow
def test_epochs_rebuild_in_the_same_processes(workers: Any) -> None:
    results = workers("rebuild", ["n0", "n1", "n2", "n3"]).finish()
    assert [r["epoch"] for r in results["n0"]] == [0, 1, 2]
    assert [r["epoch"] for r in results["n2"]] == [0]
    assert [r["epoch"] for r in results["n3"]] == [2]
    for reports in results.values():
        for got in reports:
            members = list(_EPOCHS[got["epoch"]])
            size = len(members)
            assert got["size"] == size
            assert got["sum"] == [size * (size + 1) // 2, size * 10 * (got["epoch"] + 1)]
            assert got["names"] == members
    print("build seconds (n0 per epoch):", [round(r["build_s"], 4) for r in results["n0"]])


@pytest.mark.slow
def test_sigkilled_peer_makes_every_survivor_give_up_fast(workers: Any) -> None:
    group = workers("kill", ["n0", "n1", "n2", "n3"])
    group.store.wait([f"entered/n{r}" for r in range(4)], timedelta(seconds=60))
    time.sleep(0.3)  # the survivors are now inside the blocked allreduce
    killed_at = time.time()
    group.procs["n3"].send_signal(signal.SIGKILL)
    results = group.finish(killed=["n3"])
    gave_up = {}
    for name in ("n0", "n1", "n2"):
        lost, after = results[name]
        gave_up[name] = lost["lost_at"] - killed_at
        assert "error" not in lost
        assert lost["reason"]
        assert after["close_s"] < 0.1
        assert after["next_sum"] == 6  # epoch 1 among the survivors works
    print("seconds from SIGKILL to PeerLost:", {k: round(v, 3) for k, v in gave_up.items()})
    print("reasons:", {name: results[name][0]["reason"][:90] for name in gave_up})
    assert all(0 < s < 5.0 for s in gave_up.values()), gave_up


@pytest.mark.slow
def test_abort_epoch_unblocks_waiting_ranks_and_they_exit_cleanly(workers: Any) -> None:
    group = workers("abort", ["n0", "n1", "n2"])
    group.store.wait([f"entered/n{r}" for r in range(3)], timedelta(seconds=60))
    time.sleep(0.3)
    aborted_at = time.time()
    abort_epoch(group.store, 0, "test: stop epoch 0", 3)
    begin = time.monotonic()
    results = group.finish(timeout_s=40)
    exit_s = time.monotonic() - begin
    for name in ("n0", "n1"):
        lost, closed = results[name]
        assert lost["reason"] == "test: stop epoch 0"
        # Heard from the abort key, not the 90 s group timeout (a loaded machine can delay
        # a poll by seconds; the usual figure is a few milliseconds).
        assert lost["lost_at"] - aborted_at < 10.0
        assert closed["close_s"] < 0.1
    assert results["n2"][0]["saw_abort"] is True
    print(f"abort to all 3 workers exited: {exit_s:.2f} s")
    assert exit_s < 40.0  # nobody waited out the 90 s group timeout on the way out


if __name__ == "__main__":
    _worker_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
