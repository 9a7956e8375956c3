"""A sharded commit's exchange (sharded_snapshot.exchange_pieces) and the buffers under it.

Members on threads of this process: each steps its owned pieces of a trained Adam's
state, and after ``exchange_pieces`` each one's snapshot payload (its segments, joined)
holds exactly what the epoch's layout says it keeps (its own chunks and a replica of
another node's), bit for bit, as if cut from the full state. The segments are views of
the state and of the receive buffer, which the epoch reuses commit after commit; a peer
that sends more or other than its share is refused by name. The payload helpers under it
(snapshot_pieces.py, comm/rounds.py) are checked here too.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
from test_shard_snapshot import _Hub, _Member

from keepstep.elastic.comm.rounds import laid_out
from keepstep.elastic.errors import BadMessage, SnapshotCorrupt
from keepstep.elastic.shard import Range
from keepstep.elastic.shard.layout import pieces_of
from keepstep.elastic.shard_epoch import epoch_shards
from keepstep.elastic.sharded_snapshot import (
    Buffers,
    exchange_pieces,
    is_pieces,
    pieces_tensor,
    snapshot_entries,
    take_pieces,
)
from keepstep.elastic.snapshot_pieces import (
    concat_pieces,
    index_pieces,
    join_segments,
    pack_payloads,
    pack_pieces,
    pack_segments,
    pack_tensor,
    unpack_pieces,
)
from keepstep.elastic.snapshot_shard import PieceKey, cut_state
from keepstep.elastic.zero import ELEMENTWISE
from shard_states import trained_adam

KEYS = ELEMENTWISE[torch.optim.Adam]
T = timedelta(seconds=10)
MEMBERS = ["n0/0", "n1/0", "n2/0"]  # one member a node


class _Wire(_Member):
    """A hub member with the commit's collective; ``tamper`` may change what it sends."""

    tamper: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    device = torch.device("cpu")

    def alltoall_tensors(
        self,
        payloads: Sequence[torch.Tensor],
        max_bytes: int,
        timeout: timedelta | None = None,
        into: Callable[[int], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        sent = list(payloads) if self.tamper is None else self.tamper(list(payloads))
        assert all(p.numel() <= max_bytes for p in sent)
        rows = self._round([p.clone() for p in sent])
        got = [rows[src][self.rank] for src in range(self.hub.world)]
        if into is None:
            return got
        buf = into(sum(g.numel() for g in got))
        views, at = [], 0
        for g in got:
            buf[at : at + g.numel()] = g
            views.append(buf[at : at + g.numel()])
            at += g.numel()
        return views


def _setup() -> tuple[dict[str, Any], list[int], Any]:
    params, opt = trained_adam()
    return (
        opt.state_dict(),
        [p.numel() for p in params],
        epoch_shards([p.numel() for p in params], MEMBERS),
    )


def _own_state(
    full: dict[str, Any], sizes: list[int], owned: Sequence[Range], anchor: bool
) -> dict[PieceKey, Any]:
    """What a member steps, as ZeroOptimizer.state_dict gives it: its owned pieces, and an
    empty parameter's state on its anchor only."""
    cut = cut_state(full, sizes, KEYS, owned)
    return {k: v for k, v in cut.items() if sizes[k.param] > 0 or anchor}


def _commit_all(
    full: dict[str, Any],
    sizes: list[int],
    shards: Any,
    buffers: list[Buffers],
    wires: list[_Wire] | None = None,
    states: list[dict[PieceKey, Any]] | None = None,
) -> list[Any]:
    hub = _Hub(len(MEMBERS))
    wires = wires or [_Wire(hub, r) for r in range(len(MEMBERS))]
    for w in wires:
        w.hub = hub
    owners = [shards.owned[m] for m in MEMBERS]
    holds = [shards.held[m] for m in MEMBERS]
    out: list[Any] = [None] * len(MEMBERS)

    def run(rank: int) -> None:
        state = _own_state(full, sizes, owners[rank], rank == 0) if states is None else states[rank]
        try:
            own, received = exchange_pieces(
                wires[rank], state, owners, holds, sizes, KEYS, T, buffers[rank]
            )
            out[rank] = pack_segments(own, received)
        except BadMessage as err:
            out[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(MEMBERS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return out


def _as_dict(raw: torch.Tensor, sizes: list[int]) -> dict[PieceKey, dict[str, list[float]]]:
    return {
        k: {n: v.tolist() if isinstance(v, torch.Tensor) else v for n, v in piece.items()}
        for k, piece in unpack_pieces(raw, sizes, KEYS).items()
    }


def test_each_member_keeps_exactly_its_holds_and_reuses_its_buffers() -> None:
    full, sizes, shards = _setup()
    buffers = [Buffers() for _ in MEMBERS]
    owned = [shards.owned[m] for m in MEMBERS]
    states = [_own_state(full, sizes, owned[r], r == 0) for r in range(len(MEMBERS))]
    first = _commit_all(full, sizes, shards, buffers, states=states)
    for rank, m in enumerate(MEMBERS):
        want = _as_dict(pieces_tensor(full, sizes, KEYS, shards.held[m]), sizes)
        got = _as_dict(join_segments(first[rank]), sizes)
        # The same elements with the same bits, however they are cut into pieces.
        assert _elements(got, sizes) == _elements(want, sizes)
    joined = [join_segments(segments) for segments in first]  # copied before they change
    storages = [{s.untyped_storage().data_ptr() for s in segments[1:]} for segments in first]
    again = _commit_all(full, sizes, shards, buffers, states=states)
    # Nothing but the header was copied: every other segment views the state or the kept
    # receive buffer, the same memory commit after commit.
    assert [{s.untyped_storage().data_ptr() for s in seg[1:]} for seg in again] == storages
    assert all(torch.equal(a, join_segments(b)) for a, b in zip(joined, again, strict=True))


def test_segments_join_into_the_payload_and_a_snapshot_reads_either_form() -> None:
    a = _pieces()
    tail = index_pieces(pack_pieces({PieceKey(1, 7, 9): {"exp_avg": torch.ones(2)}}), SIZES, KEYS)
    segments = pack_segments(a, [tail])
    assert torch.equal(join_segments(segments), pack_tensor(a, [tail]))
    value = a[PieceKey(1, 2, 6)]["exp_avg"]
    assert any(s.data_ptr() == value.data_ptr() for s in segments)  # a view, not a copy
    entries = snapshot_entries(segments)
    assert all(is_pieces(name) for name in entries) and not is_pieces("shard_pieces_x")
    extra = {"reducer": torch.zeros(2), **dict(reversed(list(entries.items())))}
    assert torch.equal(take_pieces(extra), join_segments(segments))  # type: ignore[arg-type]
    assert list(extra) == ["reducer"]  # the pieces were taken out, the rest left
    old = {"shard_pieces": pack_tensor(a)}  # a snapshot written as one tensor
    assert torch.equal(take_pieces(old), pack_tensor(a))  # type: ignore[arg-type]
    assert take_pieces({"reducer": torch.zeros(1)}) is None
    with pytest.raises(SnapshotCorrupt, match="and its segments both"):
        take_pieces({"shard_pieces": pack_tensor(a), **entries})


def test_a_checkpoint_joined_from_every_members_commit_holds_each_element_once() -> None:
    """A replica piece is its owner's piece or a part of it, so the join (longest pieces
    first) keeps the owners' and drops the replicas: one copy of the state, not two."""
    full, sizes, shards = _setup()
    raws = _commit_all(full, sizes, shards, [Buffers() for _ in MEMBERS])
    raws = [join_segments(segments) for segments in raws]
    held = [unpack_pieces(raw, sizes, KEYS) for raw in raws]
    assert sum(b - a for pieces in held for _, a, b in pieces) == 2 * sum(sizes)
    joined = unpack_pieces(concat_pieces([raw.numpy().tobytes() for raw in raws]), sizes, KEYS)
    assert sum(b - a for _, a, b in joined) == sum(sizes)
    want = _as_dict(pieces_tensor(full, sizes, KEYS, [Range(0, sum(sizes))]), sizes)
    assert _elements(_as_dict(pack_tensor(joined), sizes), sizes) == _elements(want, sizes)


def _elements(
    pieces: dict[PieceKey, dict[str, Any]], sizes: list[int]
) -> dict[tuple[int, int, str], Any]:
    """Per element and per-element key, the value; per parameter, its per-tensor values."""
    out: dict[tuple[int, int, str], Any] = {}
    for (t, a, _), piece in pieces.items():
        for name, value in piece.items():
            if name in KEYS:
                for i, x in enumerate(value):
                    out[(t, a + i, name)] = x
            else:
                out[(t, -1, name)] = value
    return out


@pytest.mark.parametrize("how", ["duplicate", "extra", "missing"])
def test_a_peer_sending_other_than_its_share_is_refused(how: str) -> None:
    full, sizes, shards = _setup()
    hub = _Hub(len(MEMBERS))
    wires = [_Wire(hub, r) for r in range(len(MEMBERS))]
    victim = 0
    offsets = [0, *itertools.accumulate(sizes)]

    def tamper(payloads: list[torch.Tensor]) -> list[torch.Tensor]:
        pieces = unpack_pieces(payloads[victim], sizes, KEYS)
        first = next(iter(pieces))
        if how == "duplicate":  # a piece already received from the anchor, sent again
            pieces[PieceKey(2, 0, 0)] = {"step": torch.tensor(3.0)}
        elif how == "extra":  # elements the victim steps itself
            r = shards.owned[MEMBERS[victim]][0]
            t, a, _ = pieces_of(offsets, r.start, r.stop)[0]
            n = 1 if sizes[t] > a else 0
            pieces[PieceKey(t, a, a + n)] = {
                "exp_avg": torch.zeros(n),
                "exp_avg_sq": torch.zeros(n),
            }
        else:
            del pieces[first]
        out = list(payloads)
        out[victim] = pack_tensor(pieces)
        return out

    wires[1].tamper = tamper
    got = _commit_all(full, sizes, shards, [Buffers() for _ in MEMBERS], wires)
    assert isinstance(got[victim], BadMessage) and "rank 1 sent state" in str(got[victim])


# ---- the payload helpers ----------------------------------------------------------------


def _pieces() -> dict[PieceKey, dict[str, Any]]:
    return {
        PieceKey(1, 2, 6): {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0), "n": 2},
        PieceKey(2, 0, 0): {"step": torch.tensor(1.0)},
    }


SIZES = [3, 10, 0]


def test_pack_with_a_tail_holds_both_payloads_pieces() -> None:
    a = _pieces()
    b = {PieceKey(1, 7, 9): {"step": torch.tensor(3.0), "exp_avg": torch.tensor([7.0, 8.0])}}
    tail = index_pieces(pack_pieces(b), [3, 10, 0], KEYS)
    assert tail.keys == [PieceKey(1, 7, 9)]
    joined = pack_tensor(a, [tail])
    got = unpack_pieces(joined, [3, 10, 0], KEYS)
    assert list(got) == [*a, *b]
    assert got[PieceKey(1, 7, 9)]["exp_avg"].tolist() == [7.0, 8.0]
    assert got[PieceKey(1, 2, 6)]["n"] == 2 and got[PieceKey(1, 2, 6)]["exp_avg"].tolist() == [
        0,
        1,
        2,
        3,
    ]
    kept = torch.empty(joined.numel(), dtype=torch.uint8)
    assert pack_tensor(a, [tail], lambda n: kept).data_ptr() == kept.data_ptr()
    assert torch.equal(kept, joined)


def test_payloads_lie_in_one_buffer_with_zero_spare_bytes() -> None:
    buf = torch.full((4096,), 0xAB, dtype=torch.uint8)
    views = pack_payloads([_pieces(), {}, _pieces()], lambda n: buf[:n])
    assert views[1].numel() == 0
    assert all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for v in views)
    assert unpack_pieces(views[2], [3, 10, 0], KEYS).keys() == _pieces().keys()
    flat = laid_out(views)
    assert flat is not None and flat.data_ptr() == buf.data_ptr()
    ends = [v.storage_offset() + v.numel() for v in views]
    assert [int(buf[e]) for e in ends] == [0, 0, 0]
    assert flat.numel() == ends[-1] + 1
    # Not laid out so: copied together by the communicator.
    assert laid_out([views[0], views[2]]) is None
    assert laid_out([torch.zeros(3, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)]) is None
