"""The sections of bench/gpu_check.py that move bytes between memories and processes: the
snapshot copy, NCCL on one rank, gloo across processes with a kill and a rebuild (in
gpu_check_gloo.py, which also runs its child processes), a one-member job trained end
to end in two fresh processes (gpu_check_job.py), BatchNorm's buffers kept in step on
the device (gpu_check_buffers.py), and ZeRO's sharded step on the device (gpu_check_zero.py).

Where it sits: gpu_check.main calls `run(device, report)` after its own sections. Each
section starts with its checks false and turns them true as they pass, so one that raises
half-way keeps what it proved; its traceback goes to report["errors"]. A section that needs
a GPU is listed in report["not_covered_here"] on the CPU instead of run. Every wait is
bounded (a device sync excepted), so the whole stays within gpu_check's minutes.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import Store, TCPStore

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

from gpu_check_buffers import batchnorm_buffers  # noqa: E402  (beside this file)
from gpu_check_gloo import gloo_kill_rebuild  # noqa: E402  (beside this file)
from gpu_check_job import job_end_to_end  # noqa: E402  (beside this file)
from gpu_check_store import snapshot_store  # noqa: E402  (beside this file)
from gpu_check_zero import zero_on_device  # noqa: E402  (beside this file)
from keepstep.elastic.comm import Communicator  # noqa: E402
from keepstep.elastic.comm.exit_guard import EXIT_GUARD  # noqa: E402
from keepstep.elastic.comm.group import EpochSpec, GroupBuild  # noqa: E402
from keepstep.elastic.comm.nccl import NcclLink, NcclTransport  # noqa: E402
from keepstep.elastic.comm.nccl_group import observed_flavour  # noqa: E402
from keepstep.elastic.comm.nccl_policy import NcclSettings  # noqa: E402
from keepstep.elastic.comm.transport import Pending  # noqa: E402
from keepstep.elastic.comm.watch import AbortWatch, Outcome  # noqa: E402

STORE_TIMEOUT = timedelta(seconds=30)  # each call to the NCCL section's store
SNAPSHOT_BYTES = 1 << 30
MATMUL_N, MATMULS = 4096, 40
NCCL_TIMEOUT = timedelta(seconds=60)  # build, each allreduce, and the abort's release
NCCL_NUMEL = 1 << 20
NCCL_FIGURES = (  # per epoch: the figure of each stage's seconds
    {
        "init": "nccl_init_s",
        "allreduce": "nccl_first_allreduce_s",
        "abort": "nccl_abort_s",
        "close": "nccl_close_s",
    },
    {
        "init": "nccl_reinit_s",
        "allreduce": "nccl_reinit_allreduce_s",
        "abort": "nccl_reinit_abort_s",
        "close": "nccl_reinit_close_s",
    },
)


@dataclass
class Section:
    """One section's results: its checks start false and turn true as they pass."""

    checks: dict[str, bool]
    figures: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A section: its body (named as the section, its docstring's first line says what it
    covers), its checks, and whether it needs a CUDA device."""

    body: Callable[[Section, str], None]
    checks: tuple[str, ...]
    cuda_only: bool


def run(
    device: str,
    report: dict[str, Any],
    progress: Callable[[str, dict[str, Any]], None] = lambda _name, _report: None,
) -> None:
    """Run every section the device can, into report's checks, figures, details, errors;
    list the others in report["not_covered_here"] with the reason; ``progress`` is called
    with each section's name and the report as it ends."""
    report.setdefault("figures", {})
    report["not_covered_here"] = []
    for plan in PLANS:
        name, what = plan.body.__name__, (plan.body.__doc__ or "").splitlines()[0]
        if plan.cuda_only and device != "cuda":
            report["not_covered_here"].append(f"{name} ({what}): needs a CUDA device")
            continue
        section = Section(dict.fromkeys(plan.checks, False))
        try:
            plan.body(section, device)
        except Exception:
            report["errors"][name] = traceback.format_exc()[-3000:]
        report["checks"].update(section.checks)
        report["figures"].update(section.figures)
        report["details"][name] = section.details
        progress(name, report)


# -- the snapshot copy ------------------------------------------------------------------


def median_s(fn: Callable[[], object], repeats: int, *, events: bool) -> float:
    """Median seconds of ``repeats`` runs of ``fn`` after a warm one: wall time to a device
    sync (a pageable copy holds the host), or with ``events`` the current stream's time."""
    times = []
    for _ in range(repeats + 1):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
        times.append(start.elapsed_time(end) / 1000 if events else wall)
    return statistics.median(times[1:])


def snapshot_copy(section: Section, device: str) -> None:
    """D2H copy GB/s pinned vs pageable, compute slowdown under a copy; issue 22, deliverable 3

    1 GiB into pinned and into pageable memory, the copy's bits, and how much a matmul
    loop slows while pinned copies run beside it on another stream."""
    dev = torch.device(device)
    n = SNAPSHOT_BYTES // 4
    src = torch.empty(n, device=dev).uniform_(-1, 1, generator=torch.Generator(dev).manual_seed(22))
    pinned, pageable = torch.empty(n, pin_memory=True), torch.empty(n)
    pinned_s = median_s(lambda: pinned.copy_(src, non_blocking=True), 5, events=False)
    pageable_s = median_s(lambda: pageable.copy_(src), 3, events=False)
    gb = SNAPSHOT_BYTES / 1e9
    section.figures |= {
        "snapshot_pinned_gb_s": gb / pinned_s,
        "snapshot_pageable_gb_s": gb / pageable_s,
        "pinned_vs_pageable": pageable_s / pinned_s,
    }
    section.checks["snapshot_copy_exact"] = bool(
        torch.equal(pinned.to(dev), src) and torch.equal(pageable, pinned)
    )
    a = torch.randn(MATMUL_N, MATMUL_N, device=dev, generator=torch.Generator(dev).manual_seed(1))
    c = torch.empty_like(a)

    def matmuls() -> None:
        for _ in range(MATMULS):
            torch.mm(a, a, out=c)

    alone = median_s(matmuls, 3, events=True)
    copies = math.ceil(alone / pinned_s) + 1  # the copies outlast the compute
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def matmuls_under_copy() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(copies):
                pinned.copy_(src, non_blocking=True)
        matmuls()  # timed by events on the current stream: the compute only

    under = median_s(matmuls_under_copy, 3, events=True)
    section.figures |= {"compute_alone_s": alone, "compute_slowdown_under_copy": under / alone}
    section.details |= {"bytes": SNAPSHOT_BYTES, "copies_beside_compute": copies}


# -- NCCL on one rank -------------------------------------------------------------------


def nccl_one_rank(section: Section, device: str) -> None:
    """NCCL init, allreduce, abort and re-init of keepstep's transport; deliverable 1

    Two epochs of one member: build, allreduce, close (abort), and the next epoch's build
    once the first let go."""
    flavour, why = observed_flavour(os.environ)
    section.details |= {"flavour": flavour.value, "flavour_why": why}
    wedged: list[str] = []  # a wedged abort is reported, not a process exit as in a worker
    settings = NcclSettings(abort_deadline=NCCL_TIMEOUT)
    transport = NcclTransport(
        torch.device(device), EXIT_GUARD.reaper, settings, on_wedged=wedged.append
    )
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    try:
        for epoch, check in enumerate(("nccl_one_rank_allreduce", "nccl_reinit")):
            ok, seconds, group = nccl_epoch(store, transport, epoch)
            section.checks[check] = ok and not wedged
            section.details[f"epoch_{epoch}_group"] = group
            names = NCCL_FIGURES[epoch]
            section.figures |= {names[stage]: s for stage, s in seconds.items()}
    finally:
        section.details["wedged"] = wedged


def nccl_epoch(
    store: Store, transport: NcclTransport, epoch: int
) -> tuple[bool, dict[str, float], str]:
    """One epoch's (allreduce correct, seconds of each stage, torch group class)."""
    spec = EpochSpec(epoch, ("solo",), "solo", NCCL_TIMEOUT, "127.0.0.1")
    start = time.perf_counter()
    # Communicator.create builds no group for one member (its collectives are then local),
    # so the group is built as create does for several (Communicator.over), and handed to
    # a Communicator, which owns it and aborts it at close.
    build = GroupBuild(store, spec, transport)
    watch = AbortWatch(store, epoch, spec.rank, spec.size)
    try:
        link = build.result(watch)
    except BaseException:
        watch.close()
        raise
    built = time.perf_counter()
    comm = Communicator(spec, watch, link, built - start, transport)
    assert isinstance(link, NcclLink), type(link)
    group = type(link.raw).__name__
    try:
        t = torch.arange(NCCL_NUMEL, dtype=torch.float32, device=transport.device)
        expected = t.clone()
        done(watch, link.allreduce(t, dist.ReduceOp.SUM, NCCL_TIMEOUT), f"{epoch}'s allreduce")
        reduced = time.perf_counter()
        # A sum over one rank is its own tensor; a gather into a NaN slot shows NCCL wrote.
        slot = torch.full_like(t, math.nan)
        done(watch, link.allgather([slot], t, NCCL_TIMEOUT), f"{epoch}'s allgather")
        ok = bool(torch.equal(t, expected) and torch.equal(slot, expected))
        closing = time.perf_counter()
    finally:
        comm.close()
    if not link.abort_returned.wait(NCCL_TIMEOUT.total_seconds()):
        raise RuntimeError(f"epoch {epoch}'s NCCL abort() did not return")
    aborted = time.perf_counter()
    if not link.released.wait(NCCL_TIMEOUT.total_seconds()):
        raise RuntimeError(f"epoch {epoch}'s NCCL communicator not released after its abort")
    seconds = {
        "init": built - start,
        "allreduce": reduced - built,
        "abort": aborted - closing,  # close() until the group's abort() returned
        "close": time.perf_counter() - closing,  # close() until the aborted group let go
    }
    return ok, seconds, group


def done(watch: AbortWatch, pending: Pending, what: str) -> None:
    """Wait (bounded) for one collective as the Communicator does; raise if it failed."""
    deadline = time.monotonic() + NCCL_TIMEOUT.total_seconds()
    outcome = watch.wait(pending.ready, deadline, threading.Event())
    if outcome is not Outcome.DONE:
        raise RuntimeError(f"epoch {what}: {outcome.value}")
    pending.result()


PLANS = (
    Plan(snapshot_copy, ("snapshot_copy_exact",), cuda_only=True),
    Plan(snapshot_store, ("store_copy_exact", "store_slots_pinned"), cuda_only=True),
    Plan(nccl_one_rank, ("nccl_one_rank_allreduce", "nccl_reinit"), cuda_only=True),
    Plan(
        gloo_kill_rebuild,
        ("gloo_allreduce_equal", "gloo_kill_detected", "gloo_rebuild_equal"),
        cuda_only=False,
    ),
    Plan(job_end_to_end, ("job_trains", "job_fresh_process_equal"), cuda_only=False),
    Plan(
        batchnorm_buffers,
        ("buffers_members_agree", "buffers_device_mean_is_cpu"),
        cuda_only=False,
    ),
    Plan(
        zero_on_device,
        ("zero_threads_equal_unsharded", "zero_state_on_device", "zero_job_equals_unsharded"),
        cuda_only=False,
    ),
)
