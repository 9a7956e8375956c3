"""The snapshot store on a GPU (issue 22, deliverable 3), a section of bench/gpu_check.py.

A 1B-parameter model's state as AdamW keeps it (parameters and two moments, float32: 12 GB
on the device) is committed to keepstep's SnapshotStore the way a job commits it: copied
on a side stream into page-locked slots (snapshot_device.py), and for comparison into the
same slots left pageable. Checks: the page-locked store holds exactly the device's bits,
and its mapping really was page-locked. Figures: each store's copy GB/s, the checksum's,
the first commit (zero-filling the slots and locking them), and what the snapshot costs a
step it overlaps: a compute loop at least as long as a commit takes to become durable,
run alone and with a commit issued before it and waited for after it (as the Job does:
commit after the optimizer step, wait before the next).

The slots live in /dev/shm when it has room (as an agent's do), else in process memory.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "elastic") not in sys.path:
    sys.path.append(str(REPO / "elastic"))  # after PYTHONPATH's entries: those win

from keepstep.elastic.snapshot_buffer import SHM_DIR, FileBuffer, MemoryBuffer  # noqa: E402
from keepstep.elastic.snapshot_device import DeviceCopier  # noqa: E402
from keepstep.elastic.snapshot_layout import HEADER  # noqa: E402
from keepstep.elastic.snapshot_store import SnapshotBuffer, SnapshotStore  # noqa: E402

PARAMS = 10**9
PIECES = 16  # tensors per kind: a model's state is many tensors, not one
COMMITS = 3  # timed commits per store, after a first one
MATMUL_N = 4096


def model_state(device: torch.device, params: int) -> dict[str, torch.Tensor]:
    """params float32 parameters and AdamW's two moments, in PIECES tensors each."""
    gen = torch.Generator(device).manual_seed(22)
    size = math.ceil(params / PIECES)
    out = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        for i in range(PIECES):
            n = min(size, params - i * size)
            out[f"{kind}/{i}"] = torch.empty(n, device=device).uniform_(-1, 1, generator=gen)
    return out


def slot_buffer(nbytes: int, name: str) -> tuple[SnapshotBuffer, str]:
    """A buffer for two slots of ``nbytes``: in /dev/shm when it has room, else memory."""
    need = 2 * (nbytes + nbytes // 8) + 4 * HEADER
    try:
        free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    except OSError:
        free = 0
    if free > 1.2 * need:
        return FileBuffer.create(f"{name}-{os.getpid()}", directory=SHM_DIR), "dev-shm"
    return MemoryBuffer(), "memory"


def timed_commits(
    store: SnapshotStore, state: dict[str, torch.Tensor], first_step: int
) -> dict[str, float]:
    """A first commit, then COMMITS more: seconds to durable and where the copy spent them."""
    t0 = time.perf_counter()
    store.commit(first_step, state, b"gpu_check")
    store.wait(600)
    first = time.perf_counter() - t0
    durable, copy, checksum, call = [], [], [], []
    for step in range(first_step + 1, first_step + 1 + COMMITS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        store.commit(step, state, b"gpu_check")
        call.append(time.perf_counter() - t0)  # what the training thread waits for
        store.wait(600)
        durable.append(time.perf_counter() - t0)
        took = store.last_copy
        assert took is not None
        copy.append(took.copy)
        checksum.append(took.checksum)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "first_commit_s": first,
        "commit_call_s": statistics.median(call),
        "durable_s": statistics.median(durable),
        "copy_s": statistics.median(copy),
        "copy_gb_s": nbytes / 1e9 / statistics.median(copy),
        "checksum_gb_s": nbytes / 1e9 / statistics.median(checksum),
    }


def overlap_cost(
    store: SnapshotStore, state: dict[str, torch.Tensor], durable_s: float
) -> dict[str, float]:
    """A compute loop at least 1.5x as long as a durable commit: alone, and with a commit
    issued before it and waited for after it. Wall seconds, medians of 3."""
    dev = next(iter(state.values())).device
    a = torch.randn(MATMUL_N, MATMUL_N, device=dev)
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a, out=c)
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t0) / 10
    count = max(10, math.ceil(1.5 * durable_s / per_mm))

    def step(commit: int | None) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if commit is not None:
            store.commit(commit, state, b"gpu_check")
        for _ in range(count):
            torch.mm(a, a, out=c)
        torch.cuda.synchronize()
        if commit is not None:
            store.wait(600)
        return time.perf_counter() - t0

    alone = statistics.median(step(None) for _ in range(3))
    with_commit = statistics.median(step(1000 + i) for i in range(3))
    return {
        "step_s": alone,
        "step_with_snapshot_s": with_commit,
        "snapshot_cost_per_step": with_commit / alone - 1,
    }


def snapshot_store(section: Any, device: str) -> None:
    """SnapshotStore commits of a 1B-param AdamW state: pinned vs pageable slots, bits, overlap"""
    dev = torch.device(device)
    state = model_state(dev, PARAMS)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    section.details["state_bytes"] = nbytes
    for pin in (True, False):
        which = "pinned" if pin else "pageable"
        buffer, where = slot_buffer(nbytes, f"keepstep-gpu-check-{which}")
        copier = DeviceCopier(pin=pin)
        store = SnapshotStore(buffer, copier=copier)
        try:
            figures = timed_commits(store, state, 1)
            section.details[f"{which}_slots_in"] = where
            if pin:
                section.checks["store_slots_pinned"] = copier.pinning.pinned
                section.checks["store_copy_exact"] = store_holds(store, state, 1 + COMMITS)
                figures |= overlap_cost(store, state, figures["durable_s"])
            section.figures |= {f"store_{which}_{k}": v for k, v in figures.items()}
        finally:
            store.close()
            buffer.close()
            if isinstance(buffer, FileBuffer):
                buffer.unlink()
    pinned = section.figures.get("store_pinned_copy_gb_s", 0.0)
    pageable = section.figures.get("store_pageable_copy_gb_s", math.nan)
    section.figures["store_pinned_vs_pageable"] = pinned / pageable


def store_holds(store: SnapshotStore, state: dict[str, torch.Tensor], step: int) -> bool:
    """The store's snapshot of ``step`` holds the device tensors' bits (and its checksum)."""
    loaded = store.load(step)
    if sorted(loaded.tensors) != sorted(state):
        return False
    return all(torch.equal(loaded.tensors[k].to(v.device), v) for k, v in state.items())
