"""The payload collectives of an epoch's ``Communicator``: bytes of any length.

Where it sits: a base of communicator.py's ``Communicator``, which runs every round
through its ``_collective`` (abort watch, deadline, give-up). Gathering and exchanging
payloads whose lengths differ takes a round for the lengths before the bytes; a gather's
first round carries short payloads framed with their lengths (rounds.framed), so the
common small ones (member views, shard announcements) take one round. Every length a
peer announces is checked before anything is allocated for it, and a rank that refuses
one writes the abort, so its peers do not wait for it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from keepstep.elastic.comm import rounds
from keepstep.elastic.comm.rounds import EMPTY, PAD, Alloc, check_lengths, left
from keepstep.elastic.comm.transport import Link, Pending
from keepstep.elastic.comm.watch import AbortWatch
from keepstep.elastic.errors import BadMessage

__all__ = ["PayloadRounds"]


class PayloadRounds:
    """``allgather_bytes``, ``alltoall_bytes`` and ``alltoall_tensors`` over what a
    ``Communicator`` has: its rank and size, device, watch and rounds."""

    rank: int
    size: int
    me: str
    device: torch.device
    _watch: AbortWatch

    def _collective(
        self,
        what: str,
        start: Callable[[Link, timedelta], Pending] | None,
        timeout: timedelta | None,
    ) -> None:
        raise NotImplementedError

    def _allgather(
        self, what: str, mine: torch.Tensor, deadline: float, into: Alloc | None = None
    ) -> list[torch.Tensor]:
        raise NotImplementedError

    def _op_timeout(self, timeout: timedelta | None) -> timedelta:
        raise NotImplementedError

    def allgather_bytes(
        self, payload: bytes, max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        """Every member's ``payload`` in rank order; none may be longer than ``max_bytes``.

        Raw bytes only: decoding (and validating) them is the caller's. One round when
        every payload fits a frame (``rounds.framed``: its length and its first
        ``INLINE_BYTES``), a second of the payloads padded to the longest otherwise, under
        one deadline. Every rank checks every length after the first round, so all refuse
        an oversized payload together (``BadMessage`` naming its rank) instead of leaving
        the others waiting.
        """
        rounds.check_max_bytes(max_bytes)
        if self.size == 1:
            self._collective("allgather_bytes", None, timeout)
            check_lengths([len(payload)], max_bytes)
            return [bytes(payload)]
        deadline = time.monotonic() + self._op_timeout(timeout).total_seconds()
        mine = rounds.framed(payload).to(self.device)
        frames = self._allgather("allgather_bytes", mine, deadline)
        lengths = [rounds.frame_length(f) for f in frames]
        check_lengths(lengths, max_bytes)
        if max(lengths) <= rounds.INLINE_BYTES:
            return [rounds.frame_payload(f, n) for f, n in zip(frames, lengths, strict=True)]
        padded = rounds.padded(payload, max(lengths)).to(self.device)
        slots = self._allgather("allgather_bytes (long)", padded, deadline)
        return [s[:n].cpu().numpy().tobytes() for s, n in zip(slots, lengths, strict=True)]

    def alltoall_bytes(
        self, payloads: Sequence[bytes], max_bytes: int, timeout: timedelta | None = None
    ) -> list[bytes]:
        """``payloads[d]`` to rank d; returns what each rank sent here, in rank order
        (``alltoall_tensors`` over bytes)."""
        mine = [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else EMPTY for p in payloads]
        got = self.alltoall_tensors(mine, max_bytes, timeout)  # CPU payloads: CPU results
        return [g.numpy().tobytes() for g in got]

    def alltoall_tensors(
        self,
        payloads: Sequence[torch.Tensor],
        max_bytes: int,
        timeout: timedelta | None = None,
        into: Alloc | None = None,
    ) -> list[torch.Tensor]:
        """``payloads[d]`` (1-D uint8) to rank d; returns what each rank sent here, in rank
        order. Each payload is at most ``max_bytes``; an empty one sends nothing. The
        payloads lie all on the CPU or all on this communicator's device, and what comes
        back lies where they do: on the device, views of one buffer (from ``into(n)`` if
        given, on the device: one kept from the last call is written warm); CPU payloads
        over a GPU's communicator travel through the device and come back as one copy.
        Payloads laid out in one buffer on the device (``rounds.laid_out``) go as they are.

        Two rounds under one deadline: the lengths, then the bytes. Each rank checks the
        lengths it is to receive first and refuses an oversized one (``BadMessage`` naming
        the sender); its peers then time out or hear the abort it writes."""
        rounds.check_max_bytes(max_bytes)
        sizes, home = rounds.payload_sizes(payloads, self.size, self.device)
        if self.size == 1:
            self._collective("alltoall_bytes", None, timeout)
            check_lengths(sizes, max_bytes, "alltoall_bytes")
            return [payloads[0].clone()]
        self._refuse_together(sizes, max_bytes, "alltoall_bytes (sent)")
        deadline = time.monotonic() + self._op_timeout(timeout).total_seconds()
        ones = [1] * self.size
        sent = torch.tensor(sizes, dtype=torch.int64).to(self.device)
        got = torch.empty_like(sent)
        self._collective(
            "alltoall_bytes (lengths)",
            lambda k, t: k.alltoall(got, sent, ones, ones, t),
            left(deadline),
        )
        lengths = [int(n) for n in got.cpu()]
        self._refuse_together(lengths, max_bytes, "alltoall_bytes")
        came = self._exchange(list(payloads), lengths, deadline, into)
        if home.type == self.device.type:
            return came
        return list(torch.split(torch.cat(came).cpu(), lengths))  # one copy to the host

    def _exchange(
        self, payloads: list[torch.Tensor], lengths: list[int], deadline: float, into: Alloc | None
    ) -> list[torch.Tensor]:
        """An alltoall's bytes round: ``payloads[d]`` to rank d, ``lengths[s]`` from rank s;
        what came, as views of one buffer on this communicator's device."""
        # One byte of padding after each payload: gloo is not asked to move empty slices.
        in_splits, out_splits = [p.numel() + 1 for p in payloads], [n + 1 for n in lengths]
        # Laid out in one buffer where the communicator sends from: sent with no copy.
        here = rounds.same_device(payloads[0].device, self.device)
        flat = rounds.laid_out(payloads) if here else None
        if flat is None:
            pad = PAD.to(payloads[0].device)
            flat = torch.cat([t for p in payloads for t in (p, pad)])
        mine = flat.to(self.device)
        out = rounds.receive_buffer(sum(out_splits), self.device, into)
        self._collective(
            "alltoall_bytes",
            lambda k, t: k.alltoall(out, mine, out_splits, in_splits, t),
            left(deadline),
        )
        starts = [0, *itertools.accumulate(out_splits)]
        return [out[a : b - 1] for a, b in itertools.pairwise(starts)]

    def _refuse_together(self, lengths: list[int], max_bytes: int, what: str) -> None:
        """``check_lengths``; on ``BadMessage`` the peers hear the abort, not wait for us."""
        try:
            check_lengths(lengths, max_bytes, what)
        except BadMessage as err:
            self._watch.fire(f"rank {self.rank} ({self.me}): {err}")
            raise
