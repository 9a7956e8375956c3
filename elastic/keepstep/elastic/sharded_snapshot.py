"""A sharded job's snapshots: its own shard and the replicas it keeps, and the rejoin.

Where it sits: between sharded.py (the job's ZeRO-1/2) and the snapshot store. At a
commit each member sends its peers the parts of its own state they keep as replicas
(``exchange_pieces``: one ``alltoall``, no full gather; ZeRO-1 only after a full
snapshot, as it fetches its replicas entering an epoch and steps them itself), and what
it keeps by the epoch's chunked layout (shard_epoch.py: its own chunks and one replica
of another node's) goes into the snapshot in the checked wire format of
snapshot_pieces.py, as the segments of that payload (``extra/shard_pieces.00000``,
``.00001``, ...: the header, then views of the state and of the received replicas, which
the snapshot store copies in the background, off the step's path; a snapshot written
before held one tensor, ``extra/shard_pieces``, and ``take_pieces`` reads both); the
snapshot's optimizer part holds the param groups only. On entering an epoch the members
announce what their restored snapshots hold and what their new windows need, every
member computes the same disjoint plan from that (``shard.fetch``), and the pieces move
rank to rank in one ``alltoall`` (``fetch_and_join``): a member receives only what it
needs and lacks (ZeRO-1: for its windows and its replicas), from one holder each. After
the loss of one node every element still has a live copy
(tests/elastic/test_shard_snapshot.py). An element no member of the epoch holds raises
``StateMissing`` naming it on every member together, never a silently wrong state: the
job then waits for a worker outside the epoch that may hold it (job.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from datetime import timedelta
from itertools import accumulate, pairwise
from typing import Any, NamedTuple, Protocol

import torch

from keepstep.elastic.comm.rounds import Alloc, Buffers
from keepstep.elastic.errors import BadMessage, SnapshotCorrupt, StateMissing
from keepstep.elastic.shard.fetch import (
    Announcement,
    BadAnnouncement,
    decode,
    encode,
    minus,
    plan_fetches,
)
from keepstep.elastic.shard.fetch import limit as announcement_limit
from keepstep.elastic.shard.layout import Range, pieces_of
from keepstep.elastic.snapshot_pieces import (
    Indexed,
    index_pieces,
    join_segments,
    pack_payloads,
    pack_pieces,
    pack_tensor,
    unpack_pieces,
)
from keepstep.elastic.snapshot_shard import (
    PieceKey,
    cut_state,
    join_windows,
    merge,
)

__all__ = [
    "PIECES",
    "Buffers",
    "Fetched",
    "cut_pieces",
    "exchange_pieces",
    "fetch_and_join",
    "is_pieces",
    "own_pieces",
    "pieces_tensor",
    "replica_keys",
    "snapshot_entries",
    "take_pieces",
]

PIECES = "shard_pieces"  # the snapshot's extra/ tensors holding this member's pieces


def snapshot_entries(segments: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """This member's pieces (``pack_segments`` of what ``exchange_pieces`` returns) as a
    snapshot's extra tensors, ``PIECES.00000``, ``PIECES.00001``, ... in order."""
    return {f"{PIECES}.{i:05d}": segment for i, segment in enumerate(segments)}


def is_pieces(name: str) -> bool:
    """Whether ``name`` (an extra tensor's) holds pieces: ``PIECES`` or one of its segments."""
    rest = name.removeprefix(PIECES)
    return rest == "" or (rest[:1] == "." and rest[1:].isdigit())


def take_pieces(extra: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Pop the pieces out of a restored snapshot's ``extra`` tensors as one 1-D uint8
    payload: the single tensor of an older snapshot, or the segments joined in order.
    None if it holds none; ``SnapshotCorrupt`` if it holds both forms."""
    names = [name for name in extra if is_pieces(name)]
    if not names:
        return None
    if PIECES in names:
        if len(names) > 1:
            raise SnapshotCorrupt(f"the snapshot holds {PIECES} and its segments both")
        return extra.pop(PIECES).reshape(-1).view(torch.uint8)
    names.sort(key=lambda name: int(name.rpartition(".")[2]))
    return join_segments([extra.pop(name) for name in names])


class PieceExchange(Protocol):
    """What ``fetch_and_join`` needs of the epoch's ``Communicator``."""

    rank: int

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]: ...

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]: ...


def pieces_tensor(
    full: Mapping[str, Any], sizes: Sequence[int], keys: frozenset[str], ranges: Sequence[Range]
) -> torch.Tensor:
    """The pieces of ``full`` that ``ranges`` keep, as the snapshot's uint8 tensor."""
    return pack_tensor(cut_state(full, sizes, keys, ranges))


class PieceSender(Protocol):
    """What ``exchange_pieces`` needs of the epoch's ``Communicator``."""

    rank: int
    device: torch.device  # where it receives (CPU payloads come back on the CPU)

    def alltoall_tensors(
        self,
        payloads: Sequence[torch.Tensor],
        max_bytes: int,
        timeout: timedelta | None = None,
        into: Alloc | None = None,
    ) -> list[torch.Tensor]: ...


def exchange_pieces(
    comm: PieceSender,
    state: Mapping[PieceKey, Mapping[str, Any]],
    owners: Sequence[Sequence[Range]],
    holds: Sequence[Sequence[Range]],
    sizes: Sequence[int],
    keys: frozenset[str],
    timeout: timedelta,
    buffers: Buffers | None = None,
) -> tuple[dict[PieceKey, dict[str, Any]], list[Indexed]]:
    """What this member's snapshot keeps at a commit, without gathering the full state:
    its own pieces, and the replicas its peers sent (checked payloads, not copied).

    ``state``: the pieces this member steps (``ZeroOptimizer.state_dict``'s, keyed by
    the optimizer's parameter index); per rank,
    in rank order, ``owners[r]`` the ranges of the flattened state rank r steps and
    ``holds[r]`` what its snapshot keeps (its own chunks and its replicas), which every
    member computes alike from the epoch's layout. Each member sends each peer the part
    of its own state the peer keeps, and nothing else (one ``alltoall``: about 1/W of the
    state out, the replicas in); what arrives must be exactly the sender's share of this
    member's holds (``BadMessage`` otherwise), and goes into the snapshot as it came, its
    bytes copied once. Empty parameters' state goes to every member, as ``cut_state``
    keeps it in every snapshot. A collective; what it returns are views of ``state`` and
    of a receive buffer from ``buffers`` (the previous commit's, reused), so neither may
    change until the snapshot has copied them; ``pack_segments(own, received)`` is the
    snapshot's payload as segments."""
    buffers = buffers or Buffers()
    offsets = (0, *accumulate(sizes))
    me = comm.rank
    empty = {k: v for k, v in state.items() if sizes[k.param] == 0}

    kept, owned = [merge(h) for h in holds], [merge(o) for o in owners]

    def share(r: int, of: int) -> tuple[Range, ...]:  # rank `of`'s part of r's holds
        return _meet(kept[r], owned[of])

    sends = [
        {} if r == me else {**cut_pieces(state, offsets, keys, share(r, me)), **empty}
        for r in range(len(holds))
    ]
    # Packed where the communicator sends from (on a GPU: device to device, no host copy).
    payloads = pack_payloads(sends, buffers.alloc("send", comm.device))
    values = (sum(sizes) + len(sizes)) * (len(keys) + 2)
    recv = buffers.alloc("recv", comm.device)
    got = comm.alltoall_tensors(payloads, 16 * values + (1 << 24), timeout, recv)
    own = own_pieces(state, owners, holds, sizes, keys, me)
    seen = set(own)
    received = []
    for rank, raw in enumerate(got):
        if rank == me:
            continue
        theirs = index_pieces(raw, sizes, keys) if raw.numel() else None
        pieces = theirs.keys if theirs is not None else []
        sent = merge(Range(offsets[t] + a, offsets[t] + b) for t, a, b in pieces)
        if sent != share(me, rank) or seen.intersection(pieces) or len(set(pieces)) < len(pieces):
            raise BadMessage(
                f"rank {rank} sent state for {[tuple(r) for r in sent[:4]]} in {len(pieces)} "
                f"pieces; its share of rank {me}'s replicas is "
                f"{[tuple(r) for r in share(me, rank)[:4]]}, each piece once"
            )
        seen.update(pieces)
        if theirs is not None:
            received.append(theirs)
    return own, received


def own_pieces(
    state: Mapping[PieceKey, Mapping[str, Any]],
    owners: Sequence[Sequence[Range]],
    holds: Sequence[Sequence[Range]],
    sizes: Sequence[int],
    keys: frozenset[str],
    rank: int,
) -> dict[PieceKey, dict[str, Any]]:
    """What of its own state (``exchange_pieces``' ``state``) rank ``rank``'s snapshot keeps:
    the pieces its holds meet its owned ranges in, and any empty parameter's state."""
    offsets = (0, *accumulate(sizes))
    ranges = _meet(merge(holds[rank]), merge(owners[rank]))
    empty = {k: dict(v) for k, v in state.items() if sizes[k.param] == 0}
    return {**cut_pieces(state, offsets, keys, ranges), **empty}


def _meet(a: Sequence[Range], b: Sequence[Range]) -> tuple[Range, ...]:
    """The elements in both ``a`` and ``b`` (each sorted, disjoint)."""
    out: list[Range] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i].start, b[j].start), min(a[i].stop, b[j].stop)
        if lo < hi:
            out.append(Range(lo, hi))
        if a[i].stop < b[j].stop:
            i += 1
        else:
            j += 1
    return merge(out)


def replica_keys(
    holds: Sequence[Range], owned: Sequence[Range], sizes: Sequence[int]
) -> list[PieceKey]:
    """The pieces a member keeps as replicas: its ``holds`` outside what it ``owned``
    (ranges of the flattened state), cut per tensor, and every empty parameter's piece
    (its per-tensor state, which every member's snapshot keeps), as ``exchange_pieces``
    gives them to it."""
    offsets = (0, *accumulate(sizes))
    cut = {PieceKey(*p) for r in minus(merge(holds), merge(owned)) for p in pieces_of(offsets, *r)}
    return sorted(cut | {PieceKey(t, 0, 0) for t, size in enumerate(sizes) if size == 0})


class Fetched(NamedTuple):
    """What entering an epoch joined: the state of each window this member steps (None:
    no member's snapshot held pieces, a full snapshot of step 0), the bytes it received,
    and the state of each replica piece it was asked for (empty with ``state`` None)."""

    state: list[dict[str, Any]] | None
    received_bytes: int
    replicas: dict[PieceKey, dict[str, Any]]


def fetch_and_join(
    comm: PieceExchange,
    mine: bytes,
    windows: Sequence[PieceKey],
    sizes: Sequence[int],
    keys: frozenset[str],
    timeout: timedelta,
    replicas: Sequence[PieceKey] = (),
) -> Fetched:
    """The state of each of ``windows`` (elements of the optimizer's parameters, in its
    parameter order) and of each of the ``replicas`` pieces this member will keep (ZeRO-1:
    ``replica_keys``), joined from its snapshot pieces ``mine`` and the pieces it lacks,
    fetched by the disjoint plan; no parameter's full state is built. A collective: every
    member of the epoch calls it, with ``b""`` if its snapshot holds none.
    ``StateMissing`` (on every member) when some member needs an element that no
    member holds."""
    total = sum(sizes)
    offsets = (0, *accumulate(sizes))
    parts = unpack_pieces(mine, sizes, keys) if mine else {}
    held = merge(Range(offsets[t] + a, offsets[t] + b) for t, a, b in parts if b > a)
    need = merge(Range(offsets[t] + a, offsets[t] + b) for t, a, b in (*windows, *replicas))
    said = comm.allgather_bytes(
        encode(Announcement(held, need)), announcement_limit(total), timeout
    )
    announced = []
    for rank, raw in enumerate(said):
        try:
            announced.append(decode(raw, total))
        except BadAnnouncement as err:
            raise BadMessage(f"rank {rank}'s announcement of its pieces: {err}") from None
    if not any(a.held for a in announced):  # decided from what all members see alike
        return Fetched(None, 0, {})  # every snapshot was a full one (step 0)
    plan = plan_fetches(announced)
    if plan.lost:
        raise StateMissing(
            f"elements {[tuple(r) for r in plan.lost[:4]]} of the optimizer state have no "
            "live copy in the epoch (the worker holding them is restarting, or a double "
            "fault took an owner and its replica)"
        )
    if not any(plan.sent(src) for src in range(len(announced))):
        # Every member holds what it needs (the usual loss: the replicas' keepers own the
        # lost chunks now). All see the same plan, so all skip the round together.
        return _joined([parts], windows, replicas, keys, 0)
    payloads = [
        pack_pieces(cut_pieces(parts, offsets, keys, ranges)) if ranges else b""
        for ranges in plan.sends[comm.rank]
    ]
    values = (total + len(sizes)) * (len(keys) + 2)
    limit = 16 * values + (1 << 24)  # 8 bytes a value, twice over; headers well inside
    got = comm.alltoall_bytes(payloads, limit, timeout)
    joined = [parts, *(unpack_pieces(raw, sizes, keys) for raw in got if raw)]
    return _joined(joined, windows, replicas, keys, sum(len(raw) for raw in got))


def _joined(
    parts: Sequence[Mapping[PieceKey, Mapping[str, Any]]],
    windows: Sequence[PieceKey],
    replicas: Sequence[PieceKey],
    keys: frozenset[str],
    received: int,
) -> Fetched:
    kept = join_windows(parts, replicas, keys) if replicas else []
    return Fetched(
        join_windows(parts, windows, keys), received, dict(zip(replicas, kept, strict=True))
    )


def cut_pieces(
    parts: Mapping[PieceKey, Mapping[str, Any]],
    offsets: Sequence[int],
    keys: frozenset[str],
    ranges: Sequence[Range],
) -> dict[PieceKey, dict[str, Any]]:
    """The elements ``ranges`` (of the flattened state) out of the pieces ``parts``
    holds, which must cover them: per-element values sliced, per-tensor ones as they are."""
    by_param: dict[int, list[PieceKey]] = {}
    for key in sorted(parts):
        by_param.setdefault(key.param, []).append(key)
    # Bisection needs the pieces' stops in order: true unless pieces overlap (a seed
    # joined from a checkpoint's parts may hold overlapping ones).
    stops = {
        t: [k.stop for k in ks]
        for t, ks in by_param.items()
        if all(x.start >= y.stop for y, x in pairwise(ks))
    }
    out: dict[PieceKey, dict[str, Any]] = {}
    for r in ranges:
        for t, a, b in pieces_of(offsets, r.start, r.stop):
            held = by_param.get(t, [])
            first = bisect_right(stops[t], a) if t in stops else 0
            for key in held[first:]:
                if key.start >= b:
                    break
                lo, hi = max(a, key.start), min(b, key.stop)
                if lo >= hi:
                    continue
                piece = parts[key]
                out[PieceKey(t, lo, hi)] = {
                    k: v[lo - key.start : hi - key.start] if k in keys else v
                    for k, v in piece.items()
                }
    return out
