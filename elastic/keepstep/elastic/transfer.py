"""Entering an epoch, the wire part: every member's view, and the resume step's snapshot
sent from the member that holds it to the members that need it.

Where it sits: `job_epoch.enter` exchanges views here, decides with the pure
`rollback.resume_plan`, and (when some member lacks the resume step: a joiner, a restarted
worker whose node lost its snapshot) transfers the snapshot here before restoring it.

What arrives is bounded before it is allocated: views by `VIEW_MAX_BYTES` (JSON, never
pickle), a snapshot by a limit derived from this member's own model (a snapshot holds the
parameters, the optimizer's slots and the tracked state, which are a few copies of the
parameters at most). A peer that announces more is refused on every member that would
receive it (`BadMessage`), never allocated. The snapshot crosses in broadcasts of at most
`TRANSFER_CHUNK_BYTES` (`broadcast_bytes`): no side holds a second whole copy for the wire,
and an NCCL epoch stages it through one device tensor of that size.

Each view carries its member's numerics fingerprint (numerics.py): in exact mode members
whose kernels may round differently are refused here, before any step (`NumericsMismatch`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch

from keepstep.elastic.comm import Communicator
from keepstep.elastic.errors import BadMessage, ConfigError
from keepstep.elastic.numerics import agree, current
from keepstep.elastic.reduce_base import ReduceMode
from keepstep.elastic.rollback import VIEW_MAX_BYTES, MemberView, ResumePlan
from keepstep.elastic.snapshot_store import SnapshotStore

# A snapshot holds the parameters and buffers, the optimizer's slots (Adam: two more
# copies), tracked state (an EMA: one more) and its index: far under this many copies of
# the model's state, plus a fixed allowance for small models' meta and tracked values.
SNAPSHOT_COPIES_MAX = 8
SNAPSHOT_SLACK_BYTES = 64 << 20
# A snapshot crosses the wire in broadcasts of at most this many bytes (transfer_snapshot).
TRANSFER_CHUNK_BYTES = 64 << 20


def snapshot_limit(model: torch.nn.Module) -> int:
    """The most bytes a transferred snapshot of `model`'s job may have."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return int(SNAPSHOT_COPIES_MAX * state + SNAPSHOT_SLACK_BYTES)


@functools.cache
def numerics_of(device: torch.device, kernels: str = "eager") -> dict[str, str | int]:
    """This process's numerics fingerprint for ``device`` and a model whose kernels are
    ``kernels``, read once."""
    return current(device, kernels).as_dict()


def exchange_views(
    comm: Communicator,
    mine: MemberView,
    timeout: timedelta,
    mode: ReduceMode,
    device: torch.device,
    kernels: str = "eager",
) -> list[MemberView]:
    """Every member's view in rank order, as bounded JSON (never pickle), each with its
    member's numerics fingerprint for ``device`` and ``kernels`` (numerics.model_kernels),
    agreed in ``mode`` (``numerics.agree``)."""
    mine = replace(mine, numerics=numerics_of(device, kernels))
    blobs = comm.allgather_bytes(mine.encode(), VIEW_MAX_BYTES, timeout)
    views = [MemberView.decode(blob, rank) for rank, blob in enumerate(blobs)]
    agree(dict(zip(comm.members, (v.numerics for v in views), strict=True)), mode)
    return views


def transfer_snapshot(
    comm: Communicator,
    snapshots: SnapshotStore,
    decision: ResumePlan,
    limit: int,
    timeout: timedelta,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
) -> bool:
    """Send the source's snapshot of the resume step to the needy; True if it came here."""
    if not decision.needy:
        return False
    source = decision.source
    blob = snapshots.export(decision.resume_step) if comm.rank == source else b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=comm.device)
    comm.broadcast(size, source, timeout)
    n = int(size.item())
    if not 0 <= n <= limit:
        # Every member reads the same size: all refuse together, none waits on the others.
        raise BadMessage(
            f"rank {source} announced a snapshot of {n} bytes for step "
            f"{decision.resume_step}; this job's snapshots are at most {limit} bytes"
        )
    got = broadcast_bytes(comm, blob, n, source, timeout, chunk_bytes)
    if got is None or comm.rank not in decision.needy:
        return False
    snapshots.import_(got)
    return True


def broadcast_bytes(
    comm: Communicator,
    blob: bytes,
    n: int,
    source: int,
    timeout: timedelta,
    chunk_bytes: int = TRANSFER_CHUNK_BYTES,
) -> bytearray | None:
    """The source's ``blob`` (``n`` bytes, known to all) on every other member (the source
    gets None), sent in broadcasts of at most ``chunk_bytes``: the wire never needs a second
    whole copy of a snapshot, and over NCCL each chunk passes through one device tensor of
    that size. Each chunk's broadcast has ``timeout``."""
    if chunk_bytes < 1:
        raise ConfigError(f"chunk_bytes={chunk_bytes!r}: must be >= 1")
    sending = comm.rank == source
    if sending and len(blob) != n:
        raise ConfigError(f"a blob of {len(blob)} bytes, but {n} were announced")
    out = None if sending else bytearray(n)
    if n == 0:
        return out
    chunk, on_device = min(chunk_bytes, n), comm.device.type != "cpu"
    # The source stages each chunk of its read-only blob; a receiver on the CPU receives
    # straight into its result; on a device every chunk passes through `wire`.
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=on_device) if sending else None
    wire = torch.empty(chunk, dtype=torch.uint8, device=comm.device) if on_device else None
    whole = None if out is None else torch.frombuffer(out, dtype=torch.uint8)
    for lo in range(0, n, chunk):
        m = min(chunk, n - lo)
        if host is not None:
            host.numpy()[:m] = np.frombuffer(blob, dtype=np.uint8, count=m, offset=lo)
            part = host[:m]
        else:
            assert whole is not None
            part = whole[lo : lo + m]
        if wire is None:
            comm.broadcast(part, source, timeout)
            continue
        if sending:
            wire[:m].copy_(part)
        comm.broadcast(wire[:m], source, timeout)
        if not sending:
            part.copy_(wire[:m])
    return out
