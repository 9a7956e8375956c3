"""The abort key of a membership epoch: its layout in the store, and how it is written.

Where it sits: at the bottom of comm/. A rank that gives up an epoch (watch.py, through
its reader thread) and an agent that learns of a lost member first (``abort_epoch``) write
the same key; every rank's `AbortWatch` hears it. The agents, the tests and the
communicator all use the key layout from here, so it is written down once.

An abort is pushed, not polled for: whoever writes the abort key then sets one wake key
per rank, and each rank has a thread blocked in a store wait on its own wake key.
"""

from __future__ import annotations

import re
from typing import Any, cast

from torch._C._distributed_c10d import Store

from keepstep.elastic.errors import ConfigError

_REASON_MAX_CHARS = 300


def abort_key(epoch: int) -> str:
    """The store key whose presence means epoch ``epoch`` is over; its value is the reason."""
    return f"keepstep/abort/{epoch}"


def wake_key(epoch: int, rank: int) -> str:
    """The key rank ``rank``'s listener waits on: set after the abort key, or at close."""
    return f"keepstep/abort/{epoch}/wake/{rank}"


def abort_epoch(store: Store, epoch: int, reason: str, ranks: int) -> None:
    """Make every collective of ``epoch`` (``ranks`` members) give up, on every rank, at once.

    The first reason written wins: later ones are usually echoes of the first failure.
    """
    check_epoch(epoch)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"ranks must be an int >= 1 (the epoch's size), got {ranks!r}")
    store.compare_set(abort_key(epoch), "", reason or "aborted")
    wake(store, epoch, range(ranks))


def wake(store: Store, epoch: int, ranks: range) -> None:
    """Set the wake keys of ``ranks``: one round trip for all of them."""
    # torch's stubs lack multi_set; every store has it.
    cast(Any, store).multi_set([wake_key(epoch, r) for r in ranks], ["wake"] * len(ranks))


def check_epoch(epoch: int) -> None:
    """ConfigError unless ``epoch`` is an epoch number (an int >= 0, not a bool)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ConfigError(f"epoch must be an int >= 0, got {epoch!r}")


def short_reason(err: BaseException) -> str:
    """The first line of ``err``, bounded, as it goes into an abort reason."""
    lines = str(err).strip().splitlines()
    # gloo prefixes its messages with "[/path/of/its/source.cc:561] ": noise in a reason.
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(err).__name__
    return text[:_REASON_MAX_CHARS]
