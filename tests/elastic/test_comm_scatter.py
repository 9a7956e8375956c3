"""``Communicator.reduce_scatter``, ``allgather`` and ``alltoall_tensors`` over gloo.

Three ranks on threads of this process over a HashStore. ``reduce_scatter`` is ZeRO-2's
half of the exact sum: each rank receives the sum over members of its slice, and for the
exact mode's integers held in float64 the bits do not depend on the order of additions.
``allgather`` is ZeRO's parameter gather: every rank's tensor, bytes as they were sent.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from test_comm import _create_on_threads  # the two-rank tests' builder, on threads
from test_comm_alltoall import _on_threads
from torch._C._distributed_c10d import HashStore

from keepstep.elastic.comm.gloo import ALLGATHER_ROUNDS_BYTES
from keepstep.elastic.comm.rounds import Buffers, receive_buffer
from keepstep.elastic.errors import ConfigError, PeerLost

MEMBERS = ["a", "b", "c"]
_T = timedelta(seconds=10)


def _integers(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-(2**50), 2**50, (n,), generator=g).to(torch.float64)


def test_each_rank_receives_the_exact_sum_of_its_slice() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)
    n = 1000  # per rank
    sent = [_integers(r, 3 * n) for r in range(3)]
    got = _on_threads(comms, lambda r, c: c.reduce_scatter(sent[r], _T))
    total = sum(t.to(torch.int64) for t in sent)  # the integers' exact sum
    assert isinstance(total, torch.Tensor)
    for r in range(3):
        assert got[r].dtype == torch.float64
        assert torch.equal(got[r].to(torch.int64), total[r * n : (r + 1) * n])
    # A second round on the same epoch, of another length.
    got = _on_threads(comms, lambda r, c: c.reduce_scatter(torch.full((3,), r + 1.0), _T))
    assert [g.tolist() for g in got] == [[6.0]] * 3


def test_reduce_scatter_receives_into_a_kept_buffer_and_sums_there() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)
    kept = [Buffers() for _ in MEMBERS]
    n = 500
    for round_ in range(2):  # the second round writes the same buffer again
        sent = [_integers(r + 3 * round_, 3 * n) for r in range(3)]
        got = _on_threads(
            comms, lambda r, c, s=sent: c.reduce_scatter(s[r], _T, kept[r].alloc("slices"))
        )
        total = sum(t.to(torch.int64) for t in sent)
        assert isinstance(total, torch.Tensor)
        for r in range(3):
            assert torch.equal(got[r].to(torch.int64), total[r * n : (r + 1) * n])
            buffer = kept[r].alloc("slices")(3 * n * 8)  # the same one, asked again
            assert got[r].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    for c in comms:
        c.close()


def test_allgather_returns_every_ranks_bytes_in_rank_order() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)
    mine = [torch.arange(5, dtype=torch.uint8) + 10 * r for r in range(3)]
    got = _on_threads(comms, lambda r, c: c.allgather(mine[r], _T))
    for r in range(3):
        assert [g.tolist() for g in got[r]] == [m.tolist() for m in mine]


def test_a_large_allgather_goes_peer_by_peer_in_rank_order_round_after_round() -> None:
    # From ALLGATHER_ROUNDS_BYTES on, the gloo transport runs one alltoall per peer
    # (each receiving straight into its slot): rounds and peers must not mix.
    comms = _create_on_threads(HashStore(), 0, MEMBERS)
    n = ALLGATHER_ROUNDS_BYTES // 4 + 3
    shapes = [(n,), (n,), (3, n)]
    for round_, dtype in enumerate((torch.float32, torch.float32, torch.float64)):
        mine = [
            torch.arange(n * (1 + 2 * (round_ == 2)), dtype=dtype) * (r + 1) + round_
            for r in range(3)
        ]
        mine = [m.reshape(shapes[round_]) for m in mine]
        got = _on_threads(comms, lambda r, c, m=mine: c.allgather(m[r], _T))
        for r in range(3):
            assert len(got[r]) == 3
            assert all(torch.equal(g, m) for g, m in zip(got[r], mine, strict=True))
    # Rank 2 never comes: the others give up at the deadline.
    big = torch.zeros(ALLGATHER_ROUNDS_BYTES, dtype=torch.uint8)
    short = timedelta(seconds=1)
    got = _on_threads(comms[:2], lambda r, c: c.allgather(big, short))
    assert all(isinstance(g, PeerLost) for g in got), got
    for c in comms:
        c.close()


def test_alltoall_tensors_delivers_each_payload_to_its_destination() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)

    def payload(src: int, dst: int) -> torch.Tensor:  # rank 2 sends rank 0 nothing
        n = 0 if (src, dst) == (2, 0) else 3 + src + dst
        return torch.full((n,), 16 * src + dst, dtype=torch.uint8)

    got = _on_threads(
        comms, lambda r, c: c.alltoall_tensors([payload(r, d) for d in range(3)], 64, _T)
    )
    for dst in range(3):
        assert [g.tolist() for g in got[dst]] == [payload(src, dst).tolist() for src in range(3)]


def test_alltoall_tensors_sends_a_laid_out_buffer_and_receives_into_a_kept_one() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)

    def payload(src: int, dst: int) -> torch.Tensor:
        return torch.full((2 + src + dst,), 16 * src + dst, dtype=torch.uint8)

    def laid(src: int) -> list[torch.Tensor]:  # one buffer, a spare byte after each payload
        parts = [payload(src, d) for d in range(3)]
        buf = torch.cat([t for p in parts for t in (p, torch.zeros(1, dtype=torch.uint8))])
        starts = [0, *itertools.accumulate(p.numel() + 1 for p in parts)]
        return [buf[a : a + p.numel()] for a, p in zip(starts, parts, strict=False)]

    kept = [torch.empty(0, dtype=torch.uint8) for _ in range(3)]

    def into(rank: int) -> Callable[[int], torch.Tensor]:
        def get(n: int) -> torch.Tensor:
            if kept[rank].numel() != n:
                kept[rank] = torch.empty(n, dtype=torch.uint8)
            return kept[rank]

        return get

    for _ in range(2):  # the second round writes into the buffers the first one made
        got = _on_threads(comms, lambda r, c: c.alltoall_tensors(laid(r), 64, _T, into=into(r)))
        for dst in range(3):
            assert [g.tolist() for g in got[dst]] == [payload(s, dst).tolist() for s in range(3)]
            ptr = kept[dst].untyped_storage().data_ptr()
            assert all(g.untyped_storage().data_ptr() == ptr for g in got[dst])
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"into\(4\) gave torch.float32 \(4,\) on cpu"):
        receive_buffer(4, cpu, lambda n: torch.zeros(n))
    with pytest.raises(ConfigError, match=r"into\(4\) gave torch.uint8 \(5,\)"):
        receive_buffer(4, cpu, lambda n: torch.zeros(n + 1, dtype=torch.uint8))


def test_one_member_bad_arguments_and_a_lost_peer() -> None:
    (one,) = _create_on_threads(HashStore(), 0, ["a"])
    x = torch.arange(4, dtype=torch.float64)
    assert torch.equal(one.reduce_scatter(x, _T), x)
    assert [g.tolist() for g in one.allgather(x, _T)] == [x.tolist()]
    comms = _create_on_threads(HashStore(), 0, MEMBERS)
    with pytest.raises(ConfigError, match=r"multiple of 3 elements, got shape \(4,\)"):
        comms[0].reduce_scatter(x, _T)
    with pytest.raises(ConfigError, match=r"got shape \(3, 3\)"):
        comms[0].reduce_scatter(torch.zeros(3, 3), _T)
    with pytest.raises(ConfigError, match="alltoall_tensors sends 1-D uint8 tensors"):
        comms[0].alltoall_tensors([x, x, x], 64, _T)
    off = torch.zeros(2, dtype=torch.uint8, device="meta")  # neither the CPU nor gloo's device
    with pytest.raises(ConfigError, match=r"on meta: they must all be on the CPU or all on"):
        comms[0].alltoall_tensors([off, off, off], 64, _T)
    # Rank 2 never comes: the others give up at the deadline, as for any collective.
    short = timedelta(seconds=1)
    got = _on_threads(comms[:2], lambda r, c: c.reduce_scatter(torch.zeros(3), short))
    assert all(isinstance(g, PeerLost) for g in got), got
    for c in comms:
        c.close()
