"""A sharded job's durable checkpoint joined into one snapshot (sharded_checkpoint.py).

Members' snapshots are made as a sharded job makes them: the parameters whole, and the
pieces of a trained Adam's state that each member keeps (its chunks and a replica of
another node's). Joined, they hold every element's state once, bit for bit, for any
member count; parts that are not of one job at one step are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from test_shard_layout import grid

from keepstep.elastic.errors import BadMessage, SnapshotCorrupt, StateShapeError
from keepstep.elastic.sharded import optimizer_sha256
from keepstep.elastic.sharded_checkpoint import holds_pieces, join_parts
from keepstep.elastic.snapshot_pieces import concat_pieces, pack_pieces, unpack_pieces
from keepstep.elastic.snapshot_shard import PieceKey
from shard_states import KEYS, export, member_snapshots, state_of


@pytest.mark.parametrize("segments", [False, True], ids=["one-tensor", "segments"])
@pytest.mark.parametrize("members", [grid(2, 1), grid(3, 2), grid(4, 1)])
def test_the_parts_join_into_the_whole_state_bit_for_bit(
    members: list[str], segments: bool
) -> None:
    # Parts as a job writes them (segments, a different count on each member) or as
    # snapshots were written before them (one tensor).
    blobs, full, params = member_snapshots(members, segments=segments)
    assert all(holds_pieces(b) for b in blobs)
    joined = join_parts(blobs)
    got = state_of(joined, params)
    rebuilt = {"state": got["state"], "param_groups": full["param_groups"]}
    assert optimizer_sha256(rebuilt) == optimizer_sha256(full)
    assert got["step"] == 9 and got["meta"] == b'{"member": "n0/0"}'  # the first part's
    for i, p in enumerate(params):
        assert torch.equal(got["tensors"][f"model/{i}"], p.detach())
    # The parts hold every element twice (owner, replica); the join leaves out the pieces
    # that longer ones cover, but keeps ones that overlap in part (never sliced).
    raw = got["tensors"]["extra/shard_pieces"].numpy().tobytes()
    pieces = unpack_pieces(raw, [p.numel() for p in params], KEYS)
    held = sum(b - a for (_, a, b) in pieces)
    total = sum(p.numel() for p in params)
    assert total <= held < 2 * total


def test_one_part_is_not_enough_and_says_so_on_load() -> None:
    blobs, _, params = member_snapshots(grid(3, 1))
    with pytest.raises(StateShapeError, match="have no copy"):
        state_of(join_parts(blobs[:1]), params)


def test_parts_of_other_steps_or_jobs_or_unsharded_ones_are_refused() -> None:
    blobs, _, params = member_snapshots(grid(2, 1))
    later, _, _ = member_snapshots(grid(2, 1), step=10)
    with pytest.raises(SnapshotCorrupt, match="part 1 of the checkpoint is of step 10"):
        join_parts([blobs[0], later[1]])
    other = {f"model/{i}": p.detach() + 1 for i, p in enumerate(params)}
    other["extra/shard_pieces"] = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(SnapshotCorrupt, match="other parameters than part 0"):
        join_parts([blobs[0], export(9, other)])
    whole = export(9, {f"model/{i}": p.detach() for i, p in enumerate(params)})
    assert not holds_pieces(whole)
    with pytest.raises(SnapshotCorrupt, match="holds no pieces"):
        join_parts([whole])
    with pytest.raises(SnapshotCorrupt, match="not a snapshot slot"):
        join_parts([blobs[0], b"x" * 200])


def test_concat_keeps_each_piece_once_and_refuses_a_short_payload() -> None:
    a = pack_pieces({PieceKey(0, 0, 2): {"exp_avg": torch.tensor([1.0, 2.0]), "step": 3}})
    b = pack_pieces(
        {
            PieceKey(0, 0, 2): {"exp_avg": torch.tensor([1.0, 2.0]), "step": 3},
            PieceKey(1, 0, 1): {"exp_avg": torch.tensor([5.0], dtype=torch.float64)},
        }
    )
    joined = unpack_pieces(concat_pieces([a, b]), [2, 1], frozenset({"exp_avg"}))
    assert sorted(joined) == [PieceKey(0, 0, 2), PieceKey(1, 0, 1)]
    assert joined[PieceKey(1, 0, 1)]["exp_avg"].dtype == torch.float64
    with pytest.raises(BadMessage, match="payload 1: ends inside piece"):
        concat_pieces([a, b[:-4]])
    with pytest.raises(BadMessage, match="payload 0: 4 bytes left over"):
        concat_pieces([a + b"\0" * 4])
