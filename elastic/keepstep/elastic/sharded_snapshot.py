"""A sharded job's snapshots: its own shard and the replicas it keeps, and the rejoin.

Where it sits: between sharded.py (the job's ZeRO-1) and the snapshot store. At a commit
the gathered full optimizer state is cut to what this member keeps by the chunked layout
(``snapshot_holdings``: its own chunks and one replica of another node's) and goes into
the snapshot as one uint8 tensor (``extra/shard_pieces``) in the checked wire format of
snapshot_pieces.py; the snapshot's optimizer part holds the param groups only. On
entering an epoch every member sends the pieces its restored snapshot holds to all the
others (``allgather_bytes``) and each joins the full state from them, from which the
epoch's shards are cut. After the loss of one node every element still has a live copy
(tests/elastic/test_shard_snapshot.py); a double fault that takes an element's owner and
replica raises ``StateShapeError`` naming it, never a silently wrong state.

Still to come: the exchange sends every piece to every member; the disjoint
rank-to-rank transfers of the plan (shard/copies.py) would move only the lost ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch

from keepstep.elastic.shard import make_chunk_layout, node_of, place_replicas
from keepstep.elastic.shard.layout import Range
from keepstep.elastic.snapshot_pieces import pack_pieces, unpack_pieces
from keepstep.elastic.snapshot_shard import cut_state, join_states, snapshot_ranges
from keepstep.elastic.zero import ALIGN

__all__ = ["PIECES", "exchange_and_join", "pieces_tensor", "snapshot_holdings"]

PIECES = "shard_pieces"  # the snapshot's extra/ tensor holding this member's pieces


class BytesExchange(Protocol):
    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]: ...


def snapshot_holdings(sizes: Sequence[int], members: Sequence[str]) -> dict[str, tuple[Range, ...]]:
    """What each member's snapshot keeps: its own chunks and one replica on another node
    (none when all members share one node). A member named without a node ("m0", local
    runs) counts as a node of its own."""
    as_node = {m: m if "/" in m else f"{m}/0" for m in members}
    layout = make_chunk_layout(sizes, as_node.values(), align=ALIGN)
    nodes = {node_of(n) for n in as_node.values()}
    holds = snapshot_ranges(place_replicas(layout, replicas=1 if len(nodes) > 1 else 0))
    return {m: holds.get(as_node[m], ()) for m in members}


def pieces_tensor(
    full: Mapping[str, Any], sizes: Sequence[int], keys: frozenset[str], ranges: Sequence[Range]
) -> torch.Tensor:
    """The pieces of ``full`` that ``ranges`` keep, as the snapshot's uint8 tensor."""
    raw = pack_pieces(cut_state(full, sizes, keys, ranges))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def exchange_and_join(
    comm: BytesExchange,
    mine: bytes,
    sizes: Sequence[int],
    keys: frozenset[str],
    shapes: Sequence[torch.Size],
    timeout: timedelta,
) -> dict[int, dict[str, Any]] | None:
    """Every member's snapshot pieces to all, joined into the full per-parameter state;
    None when no member's snapshot held pieces (a snapshot of the full state: step 0).
    A collective: every member of the epoch calls it, with ``b""`` if it holds none."""
    values = (sum(sizes) + len(sizes)) * (len(keys) + 2)
    limit = 16 * values + (1 << 24)  # 8 bytes a value, twice over; headers well inside
    slots = comm.allgather_bytes(mine, limit, timeout)
    parts = [unpack_pieces(raw, sizes, keys) for raw in slots if raw]
    if not parts:
        return None
    return join_states(parts, sizes, keys, shapes)
