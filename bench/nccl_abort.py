"""How long torch's NCCL group takes to abort on one GPU, under the environment keepstep
sets for its epochs (comm/nccl_policy.ENV_FOR_ABORT) and variants of it: each in a fresh
process, since torch reads these variables when a group is built.

    python3 bench/nccl_abort.py          # on a CUDA machine; prints one JSON object
                                         # (exit 1 if a variant failed: its stderr's end)

Per variant: the group's build and eager connect, a first allreduce, ``abort()`` and the
group's release (its destructor joins torch's watchdog and monitor threads), in seconds,
on a one-rank legacy ProcessGroupNCCL (NCCL2, where torch has it, is not covered here:
keepstep's own check, bench/gpu_check.py, times that path). An abort is on the path of
every recovery with NCCL (one live communicator per process), so its seconds add to the
MTTR of a GPU job.

Where the ~1 s of an idle one-rank abort likely goes (first GPU run: 0.99 s under every
torch setting), as read in the sources: torch's abort() joins no thread; it runs
ncclCommAbort inside an NCCL group, and NCCL runs a destroying job blocking even for a
non-blocking communicator. That job joins NCCL's proxy service thread, which polls its
sockets with a hard-coded 500 ms timeout and looks at the abort flag only before a poll
(src/proxy.cc, 2.28 to 2.30), so it exits 0.5 to 1.0 s after the abort. The diagnostic
variants test that reading:

    nccl_trace   NCCL's and torch's own log lines (abort start, UDS thread exit, abort
                 complete; epoch / local timestamps) around the bench's marks
    idle_sweep   several build-allreduce-sleep-abort cycles in one process: a poll-phase
                 cost falls as the sleep grows (mod 0.5 s), a fixed sleep would not
    raw_nccl     ncclCommInitRank / ncclCommAbort / ncclCommDestroy through ctypes,
                 without torch's group: the same ~1 s means NCCL, not torch
    shutdown     group.shutdown() (finalize + destroy: NCCL then wakes its proxy thread
                 with a stop message; only the UDS thread's poll remains, <= 0.5 s)
    overlap      the next group built and used while the previous one's abort() runs on
                 a thread: whether keepstep could build the next epoch without waiting
                 (and whether abort() holds the GIL meanwhile)

A measurement torch or NCCL cannot make (an API it lacks) is recorded as "unavailable".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "elastic"))

from keepstep.elastic.comm.nccl_policy import ENV_FOR_ABORT  # noqa: E402

MODE = "KEEPSTEP_BENCH_ABORT_MODE"  # the bench's own: which sequence the child runs
RESULT = "BENCH_RESULT "  # prefix of the child's result line (NCCL's log shares stdout)
MARK = "BENCH_MARK "  # prefix of the child's timestamped marks (trace mode)
BUDGET_S = 100.0  # bench/gpu_session.sh kills the whole bench at 120 s
CHILD_TIMEOUT_S = 45.0

# NCCL's INIT and PROXY log lines, stamped with the epoch (comparable with time.time());
# torch's C++ INFO log (ProcessGroupNCCL's abort lines), stamped with the local time.
TRACE_ENV = {
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,PROXY",
    "NCCL_DEBUG_TIMESTAMP_LEVELS": "WARN,INFO",
    "NCCL_DEBUG_TIMESTAMP_FORMAT": "[%s.%6f] ",
    "TORCH_CPP_LOG_LEVEL": "INFO",
}
TRACE_LINE = re.compile(r"BENCH_MARK|[Aa]bort|Proxy Service|UDS|Destroy|destructor|joined")

VARIANTS: dict[str, dict[str, str]] = {
    "keepstep": dict(ENV_FOR_ABORT),
    "nccl_trace": {**ENV_FOR_ABORT, **TRACE_ENV, MODE: "trace"},
    "idle_sweep": {**ENV_FOR_ABORT, MODE: "idle_sweep"},
    "raw_nccl": {**ENV_FOR_ABORT, MODE: "raw_nccl"},
    "shutdown": {**ENV_FOR_ABORT, MODE: "shutdown"},
    "overlap": {**ENV_FOR_ABORT, MODE: "overlap"},
    "blocking_comm": {**ENV_FOR_ABORT, "TORCH_NCCL_USE_COMM_NONBLOCKING": "0"},
    "monitoring_on": {**ENV_FOR_ABORT, "TORCH_NCCL_ENABLE_MONITORING": "1"},
    # The monitor thread wakes every TORCH_NCCL_COORD_CHECK_MILSEC (1000 by default); the
    # first GPU run saw no difference (abort() only notifies it; the destructor joins it).
    "coord_check_10ms": {**ENV_FOR_ABORT, "TORCH_NCCL_COORD_CHECK_MILSEC": "10"},
    "torch_defaults": {},
}
IDLES_S = (0.0, 0.1, 0.25, 0.4, 0.6)


class _Torch:
    """torch, the device and one-rank legacy groups on it (imported in the child only)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import HashStore

        self.torch, self.dist, self.store = torch, dist, HashStore
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)

    def build(self) -> Any:
        opts = self.dist.ProcessGroupNCCL.Options()
        group: Any = self.dist.ProcessGroupNCCL(self.store(), 0, 1, opts)
        try:
            group.bound_device_id = self.device
        except AttributeError:
            pass
        group.eager_connect_single_device(self.device)
        return group

    def allreduce(self, group: Any) -> None:
        x = self.torch.ones(1 << 20, device=self.device)
        group.allreduce([x]).wait()
        self.torch.cuda.synchronize()

    def versions(self) -> dict[str, str]:
        nccl = getattr(self.torch.cuda, "nccl", None)
        return {
            "torch": self.torch.__version__,
            "nccl": str(nccl.version()) if nccl is not None else "unavailable",
        }


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _mark(label: str) -> None:
    now = time.time()
    local = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    print(f"{MARK}{label} epoch={now:.6f} local={local}", file=sys.stderr, flush=True)


def _cycle(t: _Torch, trace: bool = False) -> dict[str, float]:
    """Build, first allreduce, abort, release: the first GPU run's measurement."""
    t0 = time.perf_counter()
    group = t.build()
    t1 = time.perf_counter()
    t.allreduce(group)
    t2 = time.perf_counter()
    if trace:
        _mark("abort-begin")
    group.abort()
    t3 = time.perf_counter()
    if trace:
        _mark("abort-end")
    del group  # the last reference: ~ProcessGroupNCCL joins the watchdog and the monitor
    t4 = time.perf_counter()
    if trace:
        _mark("released")
    return {
        "build_s": t1 - t0,
        "first_allreduce_s": t2 - t1,
        "abort_s": t3 - t2,
        "release_s": t4 - t3,
    }


def _idle_sweep(t: _Torch) -> dict[str, Any]:
    """Abort after a sleep of each of IDLES_S (and once with no collective at all)."""
    out: dict[str, Any] = {"warm": _cycle(t)}
    for idle in IDLES_S:
        group = t.build()
        connected = time.perf_counter()
        t.allreduce(group)
        time.sleep(idle)
        t0 = time.perf_counter()
        group.abort()
        out[f"{round(idle * 1000)}ms"] = {
            "abort_s": time.perf_counter() - t0,
            "since_connect_s": t0 - connected,
        }
        del group
    group = t.build()
    connected = time.perf_counter()
    t0 = time.perf_counter()
    group.abort()
    out["no_collective"] = {
        "abort_s": time.perf_counter() - t0,
        "since_connect_s": t0 - connected,
    }
    del group
    return out


def _shutdown(t: _Torch) -> dict[str, Any]:
    group = t.build()
    t.allreduce(group)
    for name in ("shutdown", "_shutdown"):
        method = getattr(group, name, None)
        if method is not None:
            out: dict[str, Any] = {"method": name, "shutdown_s": _timed(method)}
            t0 = time.perf_counter()
            del group, method
            out["release_s"] = time.perf_counter() - t0
            return out
    group.abort()
    return {"shutdown_s": "unavailable: the group has no shutdown()"}


def _overlap(t: _Torch) -> dict[str, Any]:
    """The next group connected and used while the previous one's abort() runs on a
    thread (as keepstep's does), against abort-then-build on one thread."""
    out: dict[str, Any] = {"warm": _cycle(t)}
    old = t.build()
    t.allreduce(old)
    t0 = time.perf_counter()
    old.abort()
    new = t.build()
    t.allreduce(new)
    out["sequential_ready_s"] = time.perf_counter() - t0
    new.abort()
    del old, new

    retiring = t.build()
    t.allreduce(retiring)
    done: dict[str, float] = {}

    def abort(group: Any, since: float) -> None:
        group.abort()
        done["abort_s"] = time.perf_counter() - since

    t0 = time.perf_counter()
    thread = threading.Thread(target=abort, args=(retiring, t0))
    thread.start()
    fresh = t.build()
    t.allreduce(fresh)
    out["overlap_ready_s"] = time.perf_counter() - t0
    thread.join()
    out["overlap_abort_s"] = done.get("abort_s", "abort raised")
    out["new_abort_s"] = _timed(fresh.abort)
    del retiring, fresh
    return out


def _raw_nccl(t: _Torch) -> dict[str, Any]:
    """ncclCommAbort and ncclCommDestroy on a one-rank communicator made without torch's
    group (the NCCL library torch loaded, found by its soname)."""
    import ctypes

    lib = None
    for name in ("libnccl.so.2", "libnccl.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return {"raw_nccl": "unavailable: no libnccl.so.2 to load"}

    class UniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_char * 128)]  # NCCL_UNIQUE_ID_BYTES

    comm_t = ctypes.c_void_p
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(comm_t), ctypes.c_int, UniqueId, ctypes.c_int]
    lib.ncclAllReduce.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
        comm_t, ctypes.c_void_p,
    ]  # fmt: skip
    lib.ncclCommAbort.argtypes = [comm_t]
    lib.ncclCommDestroy.argtypes = [comm_t]

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned ncclResult {rc}")

    version = ctypes.c_int()
    check(lib.ncclGetVersion(ctypes.byref(version)), "ncclGetVersion")
    stream = t.torch.cuda.current_stream(t.device).cuda_stream

    def comm(idle: float) -> tuple[Any, float]:
        uid = UniqueId()
        check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        handle = comm_t()
        t0 = time.perf_counter()
        check(lib.ncclCommInitRank(ctypes.byref(handle), 1, uid, 0), "ncclCommInitRank")
        init_s = time.perf_counter() - t0
        x = t.torch.ones(1 << 20, device=t.device)
        ptr, float32, total = x.data_ptr(), 7, 0  # ncclFloat32, ncclSum
        rc = lib.ncclAllReduce(ptr, ptr, x.numel(), float32, total, handle, stream)
        check(rc, "ncclAllReduce")
        t.torch.cuda.synchronize()
        time.sleep(idle)
        return handle, init_s

    out: dict[str, Any] = {"library_version": version.value}
    handle, out["init_s"] = comm(0.0)
    out["abort_s"] = _timed(lambda: check(lib.ncclCommAbort(handle), "ncclCommAbort"))
    handle, _ = comm(0.25)
    out["abort_after_250ms_s"] = _timed(lambda: check(lib.ncclCommAbort(handle), "abort"))
    handle, _ = comm(0.0)
    out["destroy_s"] = _timed(lambda: check(lib.ncclCommDestroy(handle), "ncclCommDestroy"))
    return out


def child() -> dict[str, Any]:
    mode = os.environ.get(MODE, "abort")
    t = _Torch()
    out: dict[str, Any] = {"versions": t.versions()}
    if mode in ("abort", "trace"):
        out.update(_cycle(t, trace=mode == "trace"))
    elif mode == "idle_sweep":
        out.update(_idle_sweep(t))
    elif mode == "shutdown":
        out.update(_shutdown(t))
    elif mode == "overlap":
        out.update(_overlap(t))
    elif mode == "raw_nccl":
        try:
            out.update(_raw_nccl(t))
        except (OSError, AttributeError, RuntimeError) as e:  # no usable libnccl here
            out["raw_nccl"] = f"unavailable: {type(e).__name__}: {e}"
    else:
        raise ValueError(f"unknown {MODE}={mode!r}")
    return out


def run_variant(env: dict[str, str], timeout_s: float) -> object:
    owned = {key for variant in VARIANTS.values() for key in variant}
    environ = {k: v for k, v in os.environ.items() if k not in owned} | env
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child"],
            env=environ, capture_output=True, text=True, timeout=timeout_s, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        tail = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        if timeout_s < CHILD_TIMEOUT_S:  # cut short by the bench's budget: not a failure
            return {"skipped": f"killed at the bench's time budget ({timeout_s:.0f} s)"}
        return f"timed out after {timeout_s:.0f} s: {tail[-600:]}"
    results = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode != 0 or not results:
        return done.stderr[-800:] or done.stdout[-800:]
    result: dict[str, Any] = json.loads(results[-1][len(RESULT) :])
    if env.get(MODE) == "trace":
        lines = (done.stdout + "\n" + done.stderr).splitlines()
        picked = [
            ln.strip()[:220] for ln in lines if TRACE_LINE.search(ln) and not ln.startswith(RESULT)
        ]
        result["trace"] = picked[-40:]
    return result


def main() -> int:
    if "--child" in sys.argv:
        print(RESULT + json.dumps(child()), flush=True)
        return 0
    deadline = time.monotonic() + BUDGET_S
    out: dict[str, object] = {}
    for name, env in VARIANTS.items():
        left = deadline - time.monotonic()
        if left < 15:
            out[name] = {"skipped": "the bench's time budget is spent"}
            continue
        out[name] = run_variant(env, min(CHILD_TIMEOUT_S, left))
    print(json.dumps(out, indent=1))
    return 1 if any(isinstance(v, str) for v in out.values()) else 0  # a variant failed


if __name__ == "__main__":
    sys.exit(main())
