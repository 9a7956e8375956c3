"""Entering an epoch, the wire part: every member's view, and the resume step's snapshot
sent from the member that holds it to the members that need it.

Where it sits: `Job._agree_and_restore` exchanges views here, decides with the pure
`rollback.resume_plan`, and (when some member lacks the resume step: a joiner, a restarted
worker whose node lost its snapshot) transfers the snapshot here before restoring it.

What arrives is bounded before it is allocated: views by `VIEW_MAX_BYTES` (JSON, never
pickle), a snapshot by a limit derived from this member's own model (a snapshot holds the
parameters, the optimizer's slots and the tracked state, which are a few copies of the
parameters at most). A peer that announces more is refused on every member that would
receive it (`BadMessage`), never allocated.

Each view carries its member's numerics fingerprint (numerics.py): in exact mode members
whose kernels may round differently are refused here, before any step (`NumericsMismatch`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from datetime import timedelta

import torch

from keepstep.elastic.comm import Communicator
from keepstep.elastic.errors import BadMessage
from keepstep.elastic.numerics import agree, current
from keepstep.elastic.reduce_base import ReduceMode
from keepstep.elastic.rollback import VIEW_MAX_BYTES, MemberView, ResumePlan
from keepstep.elastic.snapshot_store import SnapshotStore

# A snapshot holds the parameters and buffers, the optimizer's slots (Adam: two more
# copies), tracked state (an EMA: one more) and its index: far under this many copies of
# the model's state, plus a fixed allowance for small models' meta and tracked values.
SNAPSHOT_COPIES_MAX = 8
SNAPSHOT_SLACK_BYTES = 64 << 20


def snapshot_limit(model: torch.nn.Module) -> int:
    """The most bytes a transferred snapshot of `model`'s job may have."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return int(SNAPSHOT_COPIES_MAX * state + SNAPSHOT_SLACK_BYTES)


@functools.cache
def numerics_of(device: torch.device) -> dict[str, str | int]:
    """This process's numerics fingerprint for ``device``, read once."""
    return current(device).as_dict()


def exchange_views(
    comm: Communicator, mine: MemberView, timeout: timedelta, mode: ReduceMode, device: torch.device
) -> list[MemberView]:
    """Every member's view in rank order, as bounded JSON (never pickle), each with its
    member's numerics fingerprint for ``device``, agreed in ``mode`` (``numerics.agree``)."""
    mine = replace(mine, numerics=numerics_of(device))
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
) -> bool:
    """Send the source's snapshot of the resume step to the needy; True if it came here."""
    if not decision.needy:
        return False
    source = decision.source
    blob = snapshots.export(decision.resume_step) if comm.rank == source else b""
    size = torch.tensor([len(blob)], dtype=torch.int64)
    comm.broadcast(size, source, timeout)
    n = int(size.item())
    if not 0 <= n <= limit:
        # Every member reads the same size: all refuse together, none waits on the others.
        raise BadMessage(
            f"rank {source} announced a snapshot of {n} bytes for step "
            f"{decision.resume_step}; this job's snapshots are at most {limit} bytes"
        )
    wire = (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        if comm.rank == source
        else torch.empty(n, dtype=torch.uint8)
    )
    comm.broadcast(wire, source, timeout)
    if comm.rank not in decision.needy:
        return False
    snapshots.import_(wire.numpy().tobytes())
    return True
