"""Cost of a membership change in the communicator, next to what torch.distributed pays.

    scripts/env python bench/comm_rebuild.py [--sizes 2 3 4] [--rebuilds 10]

For each world size W, W worker processes (this file, run with `worker ...`) on one
machine, around a TCPStore hosted here, measure three things:

- keepstep: `Communicator.create` for a new epoch in the same processes (its own gloo
  group on a fresh store prefix; the previous epoch's `close()` does not wait);
- torch: a full `init_process_group("gloo") + destroy_process_group()` cycle on a fresh
  store prefix, the usual way to rebuild without restarting processes;
- give-up: one rank is SIGKILLed while the others wait in an all-reduce (30 s group
  timeout); the time from the kill until each survivor has raised `PeerLost`. Plain gloo
  tells only the dead rank's ring neighbours; the others would wait the 30 s out.

Every rebuild starts from a store barrier; a rebuild's time is its slowest rank's, and
the table shows the median over `--rebuilds` (after one warm-up rebuild).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from keepstep.elastic.comm import Communicator
from keepstep.elastic.errors import PeerLost

_KILL_EPOCH = 1_000_000
_GROUP_TIMEOUT = timedelta(seconds=30)
_STORE_TIMEOUT = timedelta(seconds=120)


def _barrier(store: Store, name: str, size: int) -> None:
    if store.add(f"bench/{name}/arrived", 1) == size:
        store.set(f"bench/{name}/go", "1")
    store.wait([f"bench/{name}/go"], _STORE_TIMEOUT)


def _report(**fields: Any) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def worker(port: int, rank: int, size: int, rebuilds: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torch's default device, on loopback
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=_STORE_TIMEOUT)
    members = [f"w{r}" for r in range(size)]
    me = members[rank]

    create_s = []
    for epoch in range(rebuilds + 1):
        _barrier(store, f"create-{epoch}", size)
        start = time.perf_counter()
        comm = Communicator.create(store, epoch, members, me, timeout=_GROUP_TIMEOUT)
        create_s.append(time.perf_counter() - start)
        total = torch.tensor([rank + 1], dtype=torch.int64)
        comm.allreduce(total)
        assert total.item() == size * (size + 1) // 2, total
        comm.close()

    init_s, cycle_s = [], []
    for i in range(rebuilds + 1):
        _barrier(store, f"torch-{i}", size)
        prefixed = PrefixStore(f"bench/torch-{i}/", store)
        start = time.perf_counter()
        dist.init_process_group(
            "gloo", store=prefixed, rank=rank, world_size=size, timeout=_GROUP_TIMEOUT
        )
        init_s.append(time.perf_counter() - start)
        dist.destroy_process_group()
        cycle_s.append(time.perf_counter() - start)
    _report(rank=rank, create_s=create_s[1:], init_s=init_s[1:], cycle_s=cycle_s[1:])

    comm = Communicator.create(store, _KILL_EPOCH, members, me, timeout=_GROUP_TIMEOUT)
    comm.allreduce(torch.ones(4))  # every pair connected before the kill
    store.set(f"bench/entered/{rank}", "1")
    if rank == size - 1:
        time.sleep(_STORE_TIMEOUT.total_seconds())  # the victim: the driver kills it here
        return
    try:
        comm.allreduce(torch.ones(4))
        _report(rank=rank, error="all-reduce completed although a rank never joined")
    except PeerLost as lost:
        own = lost.reason.startswith(f"rank {rank} ")
        _report(rank=rank, lost_at=time.time(), own_error=own, reason=lost.reason[:120])
    comm.close()


def run_size(size: int, rebuilds: int) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(store.port), str(r), str(size), str(rebuilds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(size)
    ]
    try:
        store.wait([f"bench/entered/{r}" for r in range(size)], _STORE_TIMEOUT)
        time.sleep(0.3)  # the survivors are now blocked in the all-reduce
        killed_at = time.time()
        procs[-1].send_signal(signal.SIGKILL)
        reports: list[dict[str, Any]] = []
        for proc in procs:
            out, _ = proc.communicate(timeout=_STORE_TIMEOUT.total_seconds())
            reports += [json.loads(line[7:]) for line in out.splitlines() if line[:7] == "RESULT "]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    timings = [r for r in reports if "create_s" in r]
    lost = [r for r in reports if "lost_at" in r]
    if len(timings) != size or len(lost) != size - 1:
        raise SystemExit(f"{size} ranks: incomplete reports {reports}")

    def slowest_median(key: str) -> float:
        per_rebuild = zip(*(r[key] for r in timings), strict=True)
        return float(statistics.median(max(ranks) for ranks in per_rebuild)) * 1000

    gave_up = sorted((r["lost_at"] - killed_at) * 1000 for r in lost)
    return {
        "size": size,
        "create_ms": slowest_median("create_s"),
        "init_ms": slowest_median("init_s"),
        "cycle_ms": slowest_median("cycle_s"),
        "first_ms": gave_up[0],
        "last_ms": gave_up[-1],
        "own": sum(r["own_error"] for r in lost),
        "survivors": len(lost),
    }


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(*(int(a) for a in sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rebuilds", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, median of {args.rebuilds} rebuilds")
    print(
        f"{'ranks':>5} | {'keepstep create':>15} | {'torch init':>10} | {'init+destroy':>12} | "
        f"{'SIGKILL -> PeerLost, first / last survivor':>42}"
    )
    for size in args.sizes:
        row = run_size(size, args.rebuilds)
        give_up = (
            f"{row['first_ms']:7.1f} / {row['last_ms']:7.1f} ms "
            f"({row['own']} of {row['survivors']} saw the gloo error)"
        )
        print(
            f"{size:>5} | {row['create_ms']:12.1f} ms | {row['init_ms']:7.1f} ms | "
            f"{row['cycle_ms']:9.1f} ms | {give_up:>42}",
            flush=True,
        )


if __name__ == "__main__":
    main()
