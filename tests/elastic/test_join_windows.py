"""join_windows: a member's windows of optimizer state from pieces, never a full parameter."""

from __future__ import annotations

import pytest
import torch

from keepstep.elastic.errors import StateShapeError
from keepstep.elastic.snapshot_shard import PieceKey, join_windows

KEYS = frozenset({"exp_avg"})
FULL = torch.arange(1000, dtype=torch.float32)  # parameter 0's exp_avg, 1000 elements


def _piece(a: int, b: int, step: float = 3.0) -> dict[str, object]:
    return {"exp_avg": FULL[a:b].clone(), "step": torch.tensor(step)}


def test_a_window_joins_overlapping_pieces_from_several_members_in_a_copy_of_its_own() -> None:
    mine = {PieceKey(0, 0, 300): _piece(0, 300), PieceKey(0, 700, 1000): _piece(700, 1000)}
    theirs = {PieceKey(0, 200, 500): _piece(200, 500), PieceKey(0, 450, 800): _piece(450, 800)}
    got = join_windows([mine, theirs], [PieceKey(0, 128, 900), PieceKey(0, 0, 128)], KEYS)
    assert torch.equal(got[0]["exp_avg"], FULL[128:900])
    assert torch.equal(got[1]["exp_avg"], FULL[0:128])
    assert float(got[0]["step"]) == 3.0
    # A copy sized to the window: no full parameter built, no piece's storage shared.
    assert got[0]["exp_avg"].untyped_storage().nbytes() == (900 - 128) * 4
    got[1]["exp_avg"].zero_()
    assert torch.equal(mine[PieceKey(0, 0, 300)]["exp_avg"], FULL[0:300])


def test_a_gap_a_disagreement_or_mixed_state_is_refused_by_name() -> None:
    parts = [{PieceKey(0, 0, 300): _piece(0, 300), PieceKey(0, 400, 1000): _piece(400, 1000)}]
    with pytest.raises(
        StateShapeError, match=r"parameter 0, elements 256\.\.512: elements 300\.\.400 have no copy"
    ):
        join_windows(parts, [PieceKey(0, 256, 512)], KEYS)
    assert join_windows(parts, [PieceKey(0, 512, 1000)], KEYS)[0]["exp_avg"].numel() == 488
    other = [{PieceKey(0, 0, 500): _piece(0, 500), PieceKey(0, 500, 1000): _piece(500, 1000, 4.0)}]
    with pytest.raises(StateShapeError, match="disagree on 'step'"):
        join_windows(other, [PieceKey(0, 0, 1000)], KEYS)
    mixed = [{PieceKey(0, 0, 500): _piece(0, 500), PieceKey(0, 500, 1000): {}}]
    with pytest.raises(StateShapeError, match="different state"):
        join_windows(mixed, [PieceKey(0, 0, 1000)], KEYS)
    with pytest.raises(StateShapeError, match=r"elements 0\.\.10 have no copy"):
        join_windows(parts, [PieceKey(1, 0, 10)], KEYS)  # a parameter nobody holds


def test_a_parameter_without_state_and_an_empty_tensor() -> None:
    parts = [{PieceKey(0, 0, 1000): {}, PieceKey(1, 0, 0): {"step": torch.tensor(2.0)}}]
    got = join_windows(parts, [PieceKey(0, 0, 512), PieceKey(1, 0, 0), PieceKey(2, 0, 0)], KEYS)
    assert got[0] == {}  # no step yet: nothing to load
    assert float(got[1]["step"]) == 2.0  # the empty tensor's per-tensor state
    assert got[2] == {}
