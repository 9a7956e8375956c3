"""What the job's sharded optimizer needs of the epoch's ``Communicator``, as protocols.

Where it sits: beside sharded.py, which types its collectives with these (the
``Communicator`` has them all; tests give fakes).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from keepstep.elastic.comm.rounds import Alloc
from keepstep.elastic.sharded_snapshot import PieceExchange, PieceSender
from keepstep.elastic.zero.gather import TensorCollective

__all__ = ["GradCollective", "PieceCollective"]


class PieceCollective(TensorCollective, PieceExchange, PieceSender, Protocol):
    """What entering an epoch needs of the ``Communicator``: the gathers and ``alltoall``
    (``fetch_and_join``'s and ``exchange_pieces``' needs together)."""


class GradCollective(Protocol):
    """What ZeRO-2's reduction needs of the ``Communicator``."""

    rank: int
    size: int

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = ...,
        timeout: timedelta | None = None,
    ) -> None: ...

    def reduce_scatter(
        self, tensor: torch.Tensor, timeout: timedelta | None = None, into: Alloc | None = None
    ) -> torch.Tensor: ...
