"""Tests of keepstep.elastic.comm: per-epoch gloo groups, abort, give-up and teardown.

Here everything runs in this process (one rank, or two ranks on threads over a
HashStore); test_comm_workers.py starts real worker processes.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import HashStore, Store

from keepstep.elastic.comm import Communicator, abort_epoch, abort_key, rounds
from keepstep.elastic.errors import BadMessage, ConfigError, PeerLost

# ---- fast tests: one process -------------------------------------------------------------


def test_create_rejects_bad_arguments() -> None:
    store = HashStore()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"members": ["b", "a"], "me": "a"}, "sorted and unique"),
        ({"members": ["a", "a"], "me": "a"}, "sorted and unique"),
        ({"members": ["a", "b"], "me": "c"}, "me='c'"),
        ({"members": [], "me": "a"}, "must not be empty"),
        ({"members": ["a"], "me": "a", "epoch": -1}, "epoch must be an int >= 0, got -1"),
        ({"members": ["a"], "me": "a", "epoch": True}, "got True"),
        ({"members": ["a"], "me": "a", "timeout": timedelta(0)}, "positive timedelta"),
    ]
    for kwargs, message in cases:
        args = {"store": store, "epoch": 0, **kwargs}
        with pytest.raises(ConfigError, match=re.escape(message)):
            Communicator.create(**args)


def test_single_member_collectives_are_local() -> None:
    comm = Communicator.create(HashStore(), 3, ["solo"], "solo")
    assert (comm.epoch, comm.members, comm.rank, comm.size) == (3, ("solo",), 0, 1)
    assert comm.build_seconds >= 0.0
    t = torch.tensor([5, -7], dtype=torch.int64)
    comm.allreduce(t)
    comm.allreduce(t, dist.ReduceOp.MAX)
    comm.broadcast(t, 0)
    comm.barrier()
    assert t.tolist() == [5, -7]
    payload = b'{"step": 4}'
    assert comm.allgather_bytes(payload, 64) == [payload]
    assert comm.allgather_bytes(b"", 64) == [b""]
    with pytest.raises(BadMessage, match="rank 0 sent 65 bytes; allowed are 0 to 64"):
        comm.allgather_bytes(b"x" * 65, 64)
    with pytest.raises(ConfigError, match="max_bytes must be an int >= 1, got 0"):
        comm.allgather_bytes(payload, 0)
    assert not comm.aborted()
    comm.close()


def test_single_member_still_honours_abort() -> None:
    store = HashStore()
    comm = Communicator.create(store, 0, ["solo"], "solo")
    abort_epoch(store, 0, "agent: node drained", 1)
    assert comm.aborted()
    with pytest.raises(PeerLost, match="node drained") as info:
        comm.allreduce(torch.zeros(2))
    assert (info.value.epoch, info.value.reason) == (0, "agent: node drained")
    with pytest.raises(PeerLost, match="node drained"):  # latched
        comm.barrier()


def test_a_check_without_waiting_sees_an_abort_soon() -> None:
    store = HashStore()
    comm = Communicator.create(store, 0, ["solo"], "solo")
    assert not comm.aborted(wait=False)
    abort_epoch(store, 0, "agent: node drained", 1)
    # Each check answers from the last read and asks for a fresh one in the background.
    deadline = time.monotonic() + 5.0
    seen = False
    while not seen and time.monotonic() < deadline:
        seen = comm.aborted(wait=False)
        time.sleep(0.001)
    assert seen
    comm.close()


def test_abort_keeps_the_first_reason_and_is_per_epoch() -> None:
    store = HashStore()
    abort_epoch(store, 1, "rank 2 died", 1)
    abort_epoch(store, 1, "echo from rank 0", 1)
    assert store.get(abort_key(1)) == b"rank 2 died"
    assert not store.check([abort_key(2)])
    with pytest.raises(PeerLost, match="rank 2 died"):
        Communicator.create(store, 1, ["a"], "a")
    Communicator.create(store, 2, ["a"], "a").close()


def test_close_is_prompt_idempotent_and_latched() -> None:
    comm = Communicator.create(HashStore(), 0, ["a"], "a")
    begin = time.perf_counter()
    comm.close()
    comm.close()
    assert time.perf_counter() - begin < 0.05
    assert comm.aborted()
    with pytest.raises(PeerLost, match="communicator closed"):
        comm.allreduce(torch.zeros(1))


def test_bad_tensors_and_ranks_are_config_errors() -> None:
    comm = Communicator.create(HashStore(), 0, ["a"], "a")
    with pytest.raises(ConfigError, match="contiguous"):
        comm.allreduce(torch.zeros(4, 4).t())
    with pytest.raises(ConfigError, match="src must be a rank in"):
        comm.broadcast(torch.zeros(1), 1)
    with pytest.raises(ConfigError, match="positive timedelta"):
        comm.barrier(timeout=timedelta(seconds=-1))


def _create_on_threads(store: Store, epoch: int, members: Sequence[str]) -> list[Communicator]:
    comms: dict[str, Communicator] = {}

    def build(me: str) -> None:
        comms[me] = Communicator.create(store, epoch, members, me, timeout=timedelta(seconds=10))

    threads = [threading.Thread(target=build, args=(me,)) for me in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(comms) == list(members)
    return [comms[me] for me in members]


def test_two_ranks_on_threads_reduce_and_time_out_together() -> None:
    store = HashStore()
    a, b = _create_on_threads(store, 0, ["a", "b"])
    ta = torch.tensor([1, 2**40], dtype=torch.int64)
    tb = torch.tensor([2, 3], dtype=torch.int64)
    thread = threading.Thread(target=b.allreduce, args=(tb,))
    thread.start()
    a.allreduce(ta)
    thread.join(timeout=10)
    assert ta.tolist() == tb.tolist() == [3, 2**40 + 3]

    # b never joins: a gives up at the deadline (its own or gloo's, whichever is first) and
    # publishes why for b.
    begin = time.monotonic()
    timed_out = r"rank 0 \(a\): allreduce (timed out after 0.3 s|failed: .*Timed out)"
    with pytest.raises(PeerLost, match=timed_out):
        a.allreduce(ta, timeout=timedelta(seconds=0.3))
    assert 0.25 <= time.monotonic() - begin < 2.0
    assert b.aborted()
    with pytest.raises(PeerLost, match=r"(?i)timed out"):
        b.barrier()
    a.close()
    b.close()


def _gather_on_both(
    a: Communicator, b: Communicator, payload_a: bytes, payload_b: bytes, max_bytes: int = 16
) -> list[Any]:
    """Both ranks' ``allgather_bytes`` (on threads): what each got, or its error's text."""
    got: list[Any] = [None, None]

    def gather(rank: int, comm: Communicator, payload: bytes) -> None:
        try:
            got[rank] = comm.allgather_bytes(payload, max_bytes, timedelta(seconds=10))
        except BadMessage as error:
            got[rank] = str(error)

    threads = [
        threading.Thread(target=gather, args=(0, a, payload_a)),
        threading.Thread(target=gather, args=(1, b, payload_b)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return got


def test_two_ranks_gather_bytes_and_refuse_an_oversized_payload_together() -> None:
    a, b = _create_on_threads(HashStore(), 0, ["a", "b"])
    assert _gather_on_both(a, b, b"", b"0123456789") == [[b"", b"0123456789"]] * 2
    refused = "allgather_bytes: rank 1 sent 17 bytes; allowed are 0 to 16"
    assert _gather_on_both(a, b, b"ok", b"x" * 17) == [refused, refused]
    # Refused after the lengths' round, before a second: the epoch is intact.
    assert _gather_on_both(a, b, b"a" * 16, b"b") == [[b"a" * 16, b"b"]] * 2
    assert not a.aborted() and not b.aborted()
    a.close()
    b.close()


def test_payloads_past_the_inline_frame_take_a_second_round() -> None:
    a, b = _create_on_threads(HashStore(), 0, ["a", "b"])
    inline = rounds.INLINE_BYTES
    fits, over = bytes(range(256)) * (inline // 256), b"\x07" * (inline + 1)
    assert len(fits) == inline
    limit = 4 * inline
    cases = [(fits, b""), (fits, over), (over, b"z"), (over, over + b"!"), (b"", over * 3)]
    for pa, pb in cases:
        assert _gather_on_both(a, b, pa, pb, limit) == [[pa, pb]] * 2
    refused = f"allgather_bytes: rank 0 sent {limit + 1} bytes; allowed are 0 to {limit}"
    assert _gather_on_both(a, b, b"y" * (limit + 1), fits, limit) == [refused, refused]
    assert not a.aborted() and not b.aborted()
    a.close()
    b.close()


def test_a_frame_carries_its_length_and_head() -> None:
    frame = rounds.framed(b"abc", inline=8)
    assert frame.numel() == 16 and rounds.frame_length(frame) == 3
    assert rounds.frame_payload(frame, 3) == b"abc"
    long = rounds.framed(b"0123456789", inline=4)
    assert rounds.frame_length(long) == 10 and rounds.frame_payload(long, 4) == b"0123"
    # A peer's frame may say anything: a negative length is read as such, and refused.
    lying = rounds.framed(b"", inline=4)
    lying[:8] = torch.tensor([-5], dtype=torch.int64).view(torch.uint8)
    assert rounds.frame_length(lying) == -5
    with pytest.raises(BadMessage, match="rank 0 sent -5 bytes; allowed are 0 to 4"):
        rounds.check_lengths([rounds.frame_length(lying)], 4)


def test_create_gives_up_when_a_member_never_joins() -> None:
    store = HashStore()
    begin = time.monotonic()
    with pytest.raises(PeerLost, match=r"rank 0: building the group (timed out|failed)"):
        Communicator.create(store, 0, ["a", "b"], "a", timeout=timedelta(seconds=0.3))
    assert time.monotonic() - begin < 2.0
    assert store.check([abort_key(0)])  # so that "b", should it come late, fails at once


def test_abort_epoch_interrupts_create() -> None:
    store = HashStore()
    timer = threading.Timer(0.2, abort_epoch, args=(store, 5, "agent: b is gone", 2))
    timer.start()
    begin = time.monotonic()
    with pytest.raises(PeerLost, match="agent: b is gone"):
        Communicator.create(store, 5, ["a", "b"], "a", timeout=timedelta(seconds=30))
    assert time.monotonic() - begin < 2.0
    timer.join()


def test_close_from_another_thread_ends_a_blocked_collective() -> None:
    a, b = _create_on_threads(HashStore(), 0, ["a", "b"])
    timer = threading.Timer(0.2, a.close)
    timer.start()
    begin = time.monotonic()
    with pytest.raises(PeerLost, match="communicator closed"):
        a.allreduce(torch.zeros(3))  # b never joins
    assert time.monotonic() - begin < 2.0
    timer.join()
    b.close()


def test_giving_up_after_reading_another_ranks_abort_does_not_wait_for_the_store() -> None:
    # A rank whose own collective fails in the same slice in which it read another rank's
    # abort publishes nothing more: it used to wait out the 2 s store timeout for a write
    # its watch thread, already finished, would never make (a 2 s stall in recoveries).
    store = HashStore()
    a, b = _create_on_threads(store, 0, ["a", "b"])
    abort_epoch(store, 0, "rank 1 (b): allreduce failed: connection reset", 2)
    assert a.aborted()
    begin = time.monotonic()
    reason = a._watch.fire("rank 0 (a): allreduce failed: connection reset")
    assert reason == "rank 1 (b): allreduce failed: connection reset"  # the first one wins
    assert time.monotonic() - begin < 1.0  # not the 2 s the store is given to answer
    a.close()
    b.close()


def test_a_given_up_collective_still_writes_its_tensor_when_the_peer_comes_back() -> None:
    # Why the reducers abandon a buffer after PeerLost (reduce_base.Reducer.abandon_buffer):
    # a's work outlives its PeerLost, and b, stopped rather than dead, completes it later.
    store = HashStore()
    a, b = _create_on_threads(store, 0, ["a", "b"])
    ta = torch.tensor([1, 1], dtype=torch.int64)
    timer = threading.Timer(0.2, abort_epoch, args=(store, 0, "agent: b lost its lease", 2))
    timer.start()
    with pytest.raises(PeerLost, match="b lost its lease"):
        a.allreduce(ta, timeout=timedelta(seconds=10))
    timer.join()
    assert ta.tolist() == [1, 1]
    # b resumes inside the collective it had started before it stopped: it never looks at
    # the abort key again, its gloo work simply goes on.
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    tb = torch.tensor([2, 5], dtype=torch.int64)
    b._group.allreduce([tb], opts).wait()
    deadline = time.monotonic() + 5
    while ta.tolist() == [1, 1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ta.tolist() == [3, 6]  # written after a's PeerLost
    a.close()
    b.close()
