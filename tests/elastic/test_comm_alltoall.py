"""``Communicator.alltoall_bytes``: rank-to-rank payloads in one collective, over gloo.

Three ranks on threads of this process over a HashStore: every pair's payload arrives at
its destination only, empty payloads included; a receiver refuses an oversized payload
before the bytes travel, and its peers hear the abort it writes instead of waiting.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from test_comm import _create_on_threads  # the two-rank tests' builder, on threads
from torch._C._distributed_c10d import HashStore

from keepstep.elastic.comm import Communicator
from keepstep.elastic.errors import BadMessage, ConfigError, PeerLost

MEMBERS = ["a", "b", "c"]


def _on_threads(
    comms: Sequence[Communicator], call: Callable[[int, Communicator], Any]
) -> list[Any]:
    got: list[Any] = [None] * len(comms)

    def run(rank: int) -> None:
        try:
            got[rank] = call(rank, comms[rank])
        except (BadMessage, PeerLost) as error:
            got[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return got


def test_each_payload_reaches_its_destination_only() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)

    def payloads(src: int) -> list[bytes]:
        # Rank 1 sends nothing to rank 2; every other pair a payload naming both ends.
        return [
            b"" if (src, dst) == (1, 2) else f"{src}->{dst}".encode() * (src + 1)
            for dst in range(3)
        ]

    got = _on_threads(comms, lambda r, c: c.alltoall_bytes(payloads(r), 64, timedelta(seconds=10)))
    for dst in range(3):
        assert got[dst] == [payloads(src)[dst] for src in range(3)]
    # Payloads of every size, binary included, in a second round on the same epoch.
    blob = bytes(range(256)) * 3
    got = _on_threads(
        comms,
        lambda r, c: c.alltoall_bytes(
            [blob[: 100 * r + d] for d in range(3)], 1024, timedelta(seconds=10)
        ),
    )
    for dst in range(3):
        assert got[dst] == [blob[: 100 * src + dst] for src in range(3)]
    assert not any(c.aborted() for c in comms)
    for c in comms:
        c.close()


def test_an_oversized_payload_is_refused_by_its_receiver_and_the_others_give_up() -> None:
    comms = _create_on_threads(HashStore(), 0, MEMBERS)

    def send(rank: int, comm: Communicator) -> list[bytes]:
        out = [b"ok"] * 3
        if rank == 0:
            out = [b"ok", b"x" * 17, b"ok"]  # rank 0 is to send rank 1 too much
        return comm.alltoall_bytes(out, 16, timedelta(seconds=10))

    got = _on_threads(comms, send)
    # The sender refuses its own payload before anything travels.
    assert isinstance(got[0], BadMessage)
    assert "alltoall_bytes (sent): rank 1 sent 17 bytes; allowed are 0 to 16" in str(got[0])
    # Its peers do not wait for the rest of the collective: they give up with PeerLost.
    assert all(isinstance(g, PeerLost) for g in got[1:]), got
    for c in comms:
        c.close()


def test_a_receiver_refuses_what_a_peer_announces_beyond_the_limit() -> None:
    comms = _create_on_threads(HashStore(), 1, MEMBERS)

    def send(rank: int, comm: Communicator) -> list[bytes]:
        limit = 64 if rank == 0 else 16  # rank 0 believes larger payloads are allowed
        out = [b"y" * 40 if (rank, d) == (0, 2) else b"ok" for d in range(3)]
        return comm.alltoall_bytes(out, limit, timedelta(seconds=10))

    got = _on_threads(comms, send)
    assert isinstance(got[2], BadMessage)
    assert "alltoall_bytes: rank 0 sent 40 bytes; allowed are 0 to 16" in str(got[2])
    assert all(isinstance(g, PeerLost) for g in got[:2]), got
    for c in comms:
        c.close()


def test_one_member_and_bad_arguments() -> None:
    (solo,) = _create_on_threads(HashStore(), 2, ["solo"])
    assert solo.alltoall_bytes([b"self"], 8) == [b"self"]
    with pytest.raises(BadMessage, match=re.escape("rank 0 sent 9 bytes; allowed are 0 to 8")):
        solo.alltoall_bytes([b"x" * 9], 8)
    with pytest.raises(ConfigError, match="needs 1 payloads, got 2"):
        solo.alltoall_bytes([b"", b""], 8)
    with pytest.raises(ConfigError, match="max_bytes must be an int >= 1, got 0"):
        solo.alltoall_bytes([b""], 0)
    solo.close()
