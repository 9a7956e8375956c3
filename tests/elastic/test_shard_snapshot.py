"""Snapshots that hold a member's own shard and the replicas it keeps (snapshot_shard.py).

Pure checks first: after losing any one node every element still has a live copy, for
the contiguous and the chunked layouts and random member sets and parameter sizes (and
without replicas it does not, so the check can fail). Then the optimizer state itself: cut
per member from a trained Adam's state, one node lost, joined again from the survivors'
pieces (also after crossing the wire as bytes, snapshot_pieces.py): the same bits; a
second lost node is detected, never silently wrong; a bad payload is refused by name.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shard_layout import clusters, grid  # the member sets of the layout's tests

from keepstep.elastic.errors import BadMessage, StateMissing, StateShapeError
from keepstep.elastic.shard import Range, make_chunk_layout, make_layout, node_of, place_replicas
from keepstep.elastic.shard.layout import pieces_of
from keepstep.elastic.shard_epoch import epoch_shards
from keepstep.elastic.sharded import optimizer_sha256
from keepstep.elastic.sharded_snapshot import fetch_and_join, pieces_tensor, replica_keys
from keepstep.elastic.snapshot_pieces import (
    index_pieces,
    indexed_values,
    pack_pieces,
    unpack_pieces,
)
from keepstep.elastic.snapshot_shard import (
    PieceKey,
    cut_state,
    join_states,
    merge,
    snapshot_ranges,
    uncovered,
)
from keepstep.elastic.zero import ALIGN, ELEMENTWISE
from shard_states import trained_adam as _trained_adam

FAST = settings(max_examples=40, deadline=None)
sizes_st = st.lists(st.integers(0, 5000), min_size=1, max_size=12).filter(lambda s: sum(s) > 0)


def _node_losses(members: list[str]) -> list[tuple[str, set[str]]]:
    nodes = sorted({node_of(m) for m in members})
    return [(n, {m for m in members if node_of(m) != n}) for n in nodes]


@FAST
@given(clusters(min_nodes=2), sizes_st, st.booleans())
def test_after_any_single_node_loss_every_element_has_a_live_copy(
    members: list[str], sizes: list[int], chunked: bool
) -> None:
    layout = (
        make_chunk_layout(sizes, members, align=ALIGN) if chunked else make_layout(sizes, members)
    )
    holds = snapshot_ranges(place_replicas(layout, replicas=1))
    total = sum(sizes)
    # Every element is held twice (the owner, a replica), never both on one node.
    assert sum(r.size for rs in holds.values() for r in rs) == 2 * total
    for node, live in _node_losses(members):
        assert uncovered(holds, live, total) == (), f"losing {node}"


def test_without_replicas_a_lost_node_takes_its_shards_with_it() -> None:
    members = grid(3, 2)
    layout = make_chunk_layout([5000, 7, 3000], members, align=ALIGN)
    holds = snapshot_ranges(place_replicas(layout, replicas=0))
    gone = uncovered(holds, {m for m in members if node_of(m) != "n1"}, 8007)
    lost = sum(r.size for r in gone)
    assert lost == sum(r.size for m in members if node_of(m) == "n1" for r in layout.ranges(m))
    assert lost > 0


def test_merge_and_uncovered_tables() -> None:
    assert merge([Range(5, 9), Range(0, 2), Range(2, 4), Range(8, 12), Range(3, 3)]) == (
        Range(0, 4),
        Range(5, 12),
    )
    holds = {"a": (Range(0, 4),), "b": (Range(6, 10),), "c": (Range(3, 7),)}
    assert uncovered(holds, {"a", "b"}, 12) == (Range(4, 6), Range(10, 12))
    assert uncovered(holds, {"a", "b", "c"}, 10) == ()
    assert uncovered(holds, set(), 3) == (Range(0, 3),)


# ---- the optimizer state --------------------------------------------------------------


def test_survivors_pieces_give_back_the_full_state_and_a_double_fault_is_detected() -> None:
    params, opt = _trained_adam()
    sizes = [p.numel() for p in params]
    keys = ELEMENTWISE[torch.optim.Adam]
    full = opt.state_dict()
    members = grid(3, 2)
    layout = make_chunk_layout(sizes, members, align=ALIGN)
    holds = snapshot_ranges(place_replicas(layout, replicas=1))
    snapshots = {m: cut_state(full, sizes, keys, holds[m]) for m in members}
    # A member's snapshot holds about 2/W of the per-element state (its shard and a replica).
    elements = {m: sum(b - a for (_, a, b) in snapshots[m]) for m in members}
    assert sum(elements.values()) == 2 * sum(sizes)
    shapes = [p.shape for p in params]
    for node, live in _node_losses(members):
        state = join_states((snapshots[m] for m in sorted(live)), sizes, keys, shapes)
        rebuilt = {"state": state, "param_groups": full["param_groups"]}
        assert optimizer_sha256(rebuilt) == optimizer_sha256(full), f"losing {node}"
    # Two nodes lost: some chunk lost its owner and its replica. Named, not filled with zeros.
    only = [m for m in members if node_of(m) == "n0"]
    with pytest.raises(StateShapeError, match="have no copy"):
        join_states((snapshots[m] for m in only), sizes, keys, shapes)


def test_pieces_that_disagree_are_refused() -> None:
    params, opt = _trained_adam()
    sizes = [p.numel() for p in params]
    keys = ELEMENTWISE[torch.optim.Adam]
    full = opt.state_dict()
    a = cut_state(full, sizes, keys, (Range(0, 100),))
    b = cut_state(full, sizes, keys, (Range(50, 185),))
    for piece in b.values():
        piece["step"] = piece["step"] + 1
    with pytest.raises(StateShapeError, match="parameter 0: pieces disagree on 'step'"):
        join_states([a, b], sizes, keys)


# ---- pieces over the wire -------------------------------------------------------------


def test_pieces_cross_the_wire_and_survivors_rebuild_the_state_from_bytes() -> None:
    params, opt = _trained_adam()
    sizes = [p.numel() for p in params]
    keys = ELEMENTWISE[torch.optim.Adam]
    full = opt.state_dict()
    members = grid(3, 2)
    holds = snapshot_ranges(place_replicas(make_layout(sizes, members), replicas=1))
    wire = {m: pack_pieces(cut_state(full, sizes, keys, holds[m])) for m in members}
    live = [m for m in members if node_of(m) != "n2"]
    received = [unpack_pieces(wire[m], sizes, keys) for m in live]
    state = join_states(received, sizes, keys, [p.shape for p in params])
    rebuilt = {"state": state, "param_groups": full["param_groups"]}
    assert optimizer_sha256(rebuilt) == optimizer_sha256(full)


def _one_piece() -> bytes:
    piece = {"exp_avg": torch.arange(4, dtype=torch.float32), "step": torch.tensor(3.0), "n": 2}
    return pack_pieces({PieceKey(1, 2, 6): piece})


def _with_header(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"\x01\x02", "has no header"),
        (b"\xff" * 8 + b"[]", "longer than the payload"),
        ((2).to_bytes(8, "little") + b"{]", "not JSON"),
        (_with_header({"a": 1}), "must be a list of pieces"),
        (_with_header([[7, 0, 1, []]]), r"names no parameter of 3"),
        (_with_header([[1, 5, 11, []]]), r"outside parameter 1 of 10 elements"),
        (_with_header([[1, 0, 2, [["exp_avg", "tensor", "float32", [3]]]]]), "3 values for 0..2"),
        (_with_header([[1, 0, 2, [["exp_avg", "tensor", "quad", [2]]]]]), "dtype 'quad'"),
        (_with_header([[1, 0, 2, [["exp_avg", "tensor", "float32", [2]]]]], b"\0" * 7), "ends"),
        (_with_header([[1, 0, 2, [["n", "int", 2]]]], b"\0"), "1 bytes left over"),
        (_with_header([[1, 0, 2, [["n", "pickle", "x"]]]]), "bad value"),
        (_one_piece()[:-1], "ends before"),
    ],
)
def test_a_bad_payload_is_refused_by_name(raw: bytes, match: str) -> None:
    with pytest.raises(BadMessage, match=match):
        unpack_pieces(raw, [3, 10, 0], ELEMENTWISE[torch.optim.Adam])
    # Checked alike where it is only indexed, to be copied on whole (a commit's replicas).
    with pytest.raises(BadMessage, match=match.replace("ends before", "ends 1 bytes before")):
        index_pieces(raw, [3, 10, 0], ELEMENTWISE[torch.optim.Adam])


def test_one_piece_round_trips_exactly() -> None:
    (got,) = unpack_pieces(_one_piece(), [3, 10, 0], ELEMENTWISE[torch.optim.Adam]).items()
    key, piece = got
    assert key == PieceKey(1, 2, 6) and piece["n"] == 2 and type(piece["n"]) is int
    assert torch.equal(piece["exp_avg"], torch.arange(4, dtype=torch.float32))
    assert piece["step"].shape == () and float(piece["step"]) == 3.0


def test_unpacked_values_share_no_byte_with_the_payload_and_a_step_holds_no_payload() -> None:
    raw = torch.frombuffer(bytearray(_one_piece()), dtype=torch.uint8)
    before = raw.clone()
    (piece,) = unpack_pieces(raw, [3, 10, 0], ELEMENTWISE[torch.optim.Adam]).values()
    piece["exp_avg"].fill_(7.0)
    piece["step"].fill_(9.0)
    assert torch.equal(raw, before)  # the caller's bytes stay the caller's
    assert piece["step"].untyped_storage().nbytes() == 4  # kept state keeps no payload alive


@pytest.mark.parametrize("at", range(4))  # where the payload starts: one of them aligned
def test_indexed_values_are_the_unpacked_values_read_in_place(at: int) -> None:
    raw = _one_piece()
    buffer = torch.zeros(at + len(raw), dtype=torch.uint8)
    buffer[at:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    keys = ELEMENTWISE[torch.optim.Adam]
    (piece,) = indexed_values(
        index_pieces(buffer[at:], [3, 10, 0], keys), [3, 10, 0], keys
    ).values()
    (want,) = unpack_pieces(raw, [3, 10, 0], keys).values()
    assert piece.keys() == want.keys() and piece["n"] == want["n"]
    assert all(torch.equal(piece[k], want[k]) for k in ("exp_avg", "step"))
    # float32 values read in place where their bytes are aligned, copied where not; a
    # per-tensor value (the step) is always its own
    shares = piece["exp_avg"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    body_at = 8 + int.from_bytes(raw[:8], "little")  # exp_avg's bytes start the body
    assert shares == ((at + body_at) % 4 == 0)
    assert piece["step"].untyped_storage().nbytes() == 4


# ---- the job's glue (sharded_snapshot.py) ------------------------------------------------


class _Hub:
    """The epoch's two collectives among ``world`` members on threads of this process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list[Any] = [None] * world
        self.bytes_moved = 0
        self.alltoalls = 0  # calls of alltoall_bytes, all members together

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


class _Member:
    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def _round(self, mine: Any) -> list[Any]:
        self.hub.slots[self.rank] = mine
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()
        return out

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        assert len(payload) <= max_bytes
        return self._round(payload)

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        assert len(payloads) == self.hub.world and all(len(p) <= max_bytes for p in payloads)
        self.hub.alltoalls += 1
        rows = self._round(list(payloads))
        return [rows[src][self.rank] for src in range(self.hub.world)]


def _windows(need: list[Range], sizes: list[int]) -> list[PieceKey]:
    """The windows (parameter slices) of flattened ranges, as the job's ZeroOptimizer has them."""
    offsets = [0, *itertools.accumulate(sizes)]
    return [PieceKey(*p) for r in need for p in pieces_of(offsets, r.start, r.stop)]


def _enter(
    raws: list[bytes],
    needs: list[list[Range]],
    sizes: list[int],
    hub: Any = None,
    replicas: list[list[PieceKey]] | None = None,
) -> list[Any]:
    """fetch_and_join on every member at once: each one's Fetched, or the error it raised."""
    hub = hub or _Hub(len(raws))
    keys = ELEMENTWISE[torch.optim.Adam]
    out: list[Any] = [None] * len(raws)

    def run(rank: int) -> None:
        try:
            windows = _windows(needs[rank], sizes)
            out[rank] = fetch_and_join(
                hub.member(rank),
                raws[rank],
                windows,
                sizes,
                keys,
                timedelta(5),
                replicas[rank] if replicas else (),
            )
        except StateShapeError as err:
            out[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(raws))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return out


def test_the_job_keeps_pieces_and_fetches_what_it_lacks_after_a_loss_or_refuses() -> None:
    params, opt = _trained_adam()
    sizes = [p.numel() for p in params]
    keys = ELEMENTWISE[torch.optim.Adam]
    full = opt.state_dict()
    members = ["m0", "m1", "m2", "m3"]  # local names: each member is a node of its own
    holds = epoch_shards(sizes, members).held
    raw = {m: pieces_tensor(full, sizes, keys, holds[m]).numpy().tobytes() for m in members}
    # m2 is lost: each survivor fetches the part of its new chunks that it lacks.
    survivors = ["m0", "m1", "m3"]
    after = epoch_shards(sizes, survivors)
    needs = [list(after.owned[m]) for m in survivors]
    hub = _Hub(len(survivors))
    got = _enter([raw[m] for m in survivors], needs, sizes, hub)
    for fetched, need in zip(got, needs, strict=True):
        windows = _windows(need, sizes)
        assert fetched.state is not None and len(fetched.state) == len(windows)
        for (t, a, b), state in zip(windows, fetched.state, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):  # every needed element has the full bits
                assert torch.equal(state[key], full["state"][t][key].reshape(-1)[a:b])
            assert torch.equal(state["step"], full["state"][t]["step"])
    # Only what the new owners lacked moved: far less than the pieces everyone holds
    # (mostly each lost chunk's new owner kept its replica; the replicas' cap moved a few
    # on), and only those that lacked something received anything.
    held = sum(len(raw[m]) for m in survivors)
    assert sum(f.received_bytes for f in got) < held / 4
    lacked = [
        sum(
            max(0, min(a.stop, b.stop) - max(a.start, b.start))
            for a in after.owned[m]
            for b in uncovered({m: holds[m]}, {m}, sum(sizes))
        )
        for m in survivors
    ]
    assert [f.received_bytes > 0 for f in got] == [n > 0 for n in lacked]
    for f, n in zip(got, lacked, strict=True):  # two float32 moments, and headers
        assert 2 * 4 * n <= f.received_bytes <= 2 * 4 * n + 4096
    # A joiner holds nothing: it receives its whole share, and only it receives anything.
    grown = [*members, "m4"]
    bigger = epoch_shards(sizes, grown)
    hub = _Hub(len(grown))
    joined = _enter(
        [*(raw[m] for m in members), b""],
        [list(bigger.owned[m]) for m in grown],
        sizes,
        hub,
    )
    assert hub.alltoalls == len(grown)  # one round, every member in it
    assert all(f.state is not None for f in joined)
    assert joined[-1].received_bytes > 0
    share = sum(r.size for r in bigger.owned["m4"]) * 2 * 4  # two float32 moments
    assert share <= joined[-1].received_bytes < share + 4096 + len(raw["m0"]) // 4
    # Nobody held pieces (every snapshot was a full one): nothing to join.
    none = _enter([b"", b""], [needs[0], needs[1]], sizes)
    assert [f.state for f in none] == [None, None]
    # m1 and m2 lost: some chunk had its owner and its replica on them; both refuse.
    pair = ["m0", "m3"]
    two = epoch_shards(sizes, pair)
    refused = _enter([raw[m] for m in pair], [list(two.owned[m]) for m in pair], sizes)
    # StateMissing (a StateShapeError): the job waits for a worker from outside the epoch.
    assert all(isinstance(e, StateMissing) and "no live copy" in str(e) for e in refused)


def test_zero1_fetches_its_new_replicas_on_entering_and_moves_what_the_lost_node_held() -> None:
    """ZeRO-1 asks, entering, for the replicas it keeps in the new epoch too (it steps them
    from the first commit on): after a loss every survivor gets its windows and replicas
    with the full bits, its snapshot's holds are exactly covered, and what moves in all is
    what the lost node held (its own chunks and its replicas, each needing a new keeper)."""
    params, opt = _trained_adam()
    sizes = [p.numel() for p in params]
    keys = ELEMENTWISE[torch.optim.Adam]
    full = opt.state_dict()
    members = [f"n{i}/0" for i in range(5)]
    before = epoch_shards(sizes, members)
    raw = {m: pieces_tensor(full, sizes, keys, before.held[m]).numpy().tobytes() for m in members}
    survivors = [m for m in members if m != "n2/0"]
    after = epoch_shards(sizes, survivors, before)
    wanted = [replica_keys(after.held[m], after.owned[m], sizes) for m in survivors]
    needs = [list(after.owned[m]) for m in survivors]
    got = _enter([raw[m] for m in survivors], needs, sizes, _Hub(4), wanted)
    offsets = [0, *itertools.accumulate(sizes)]
    for m, fetched, asked in zip(survivors, got, wanted, strict=True):
        assert asked and list(fetched.replicas) == asked
        kept = merge(
            Range(offsets[t] + a, offsets[t] + b)
            for t, a, b in [*asked, *_windows(list(after.owned[m]), sizes)]
        )
        assert kept == merge(after.held[m])  # its own chunks and its replicas, no more
        for (t, a, b), state in fetched.replicas.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], full["state"][t][key].reshape(-1)[a:b])
            assert torch.equal(state["step"], full["state"][t]["step"])
    lost_held = sum(r.size for r in before.held["n2/0"])
    moved = sum(f.received_bytes for f in got)
    assert lost_held * 2 * 4 <= moved <= 1.1 * lost_held * 2 * 4 + 4 * 4096, (moved, lost_held)
    # Without the replicas (ZeRO-2), only the lost node's own chunks' windows could move.
    windows_only = _enter([raw[m] for m in survivors], needs, sizes)
    assert all(f.replicas == {} for f in windows_only)
    assert sum(f.received_bytes for f in windows_only) < moved / 2


def test_epoch_shards_own_tensor_aligned_pieces_and_keep_replicas_elsewhere() -> None:
    sizes = [300, 1, 5000, 0, 129]
    total = sum(sizes)
    offsets = [0, *itertools.accumulate(sizes)]
    alone = epoch_shards(sizes, ["m0"])
    assert alone.owned == alone.held == {"m0": (Range(0, total),)}
    same_node = epoch_shards(sizes, ["n0/0", "n0/1"])  # no other node for a replica
    assert same_node.held == same_node.owned
    members = [f"n{n}/{i}" for n in range(3) for i in range(2)]
    shards = epoch_shards(sizes, members)
    own = shards.ownership(members)  # every element owned exactly once (checked there)
    assert sum(own.owned(r) for r in range(len(members))) == total
    for m in members:
        for r in shards.owned[m]:
            for t, a, _b in pieces_of(offsets, r.start, r.stop):
                assert a % ALIGN == 0, (m, r, t, a)  # a window starts where its piece does
        assert set(shards.owned[m]) <= set(shards.held[m]) or all(
            any(h.start <= r.start and r.stop <= h.stop for h in shards.held[m])
            for r in shards.owned[m]
        )
    # Any one node lost: every element is still held by a member of another node.
    for node in range(3):
        live = [m for m in members if not m.startswith(f"n{node}/")]
        assert uncovered(shards.held, live, total) == ()
