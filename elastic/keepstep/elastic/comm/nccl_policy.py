"""The NCCL transport's decisions, as pure functions of what they observe.

Where it sits: below nccl.py, which observes (the torch build, the environment, the clock,
the work) and applies what is decided here. Nothing here touches a GPU, so every rule is
tested on the CPU:

    choose_flavour  which NCCL group torch offers: ProcessGroupNCCL2 (abort revokes work,
                    reconfigure takes a new member list) or the legacy ProcessGroupNCCL
    env_changes     the torch settings without which an abort kills the process
    plan_options    the group's options (non-blocking communicators, timeout)
    decide_claim    never more than one live communicator per process
    after_abort     wait for an aborted communicator's work, release it, or give the
                    worker up (exit: the agent restarts it from the node's snapshot)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from keepstep.elastic.errors import ConfigError

# A worker whose aborted communicator never lets go of its work exits with this status
# (EX_TEMPFAIL): the agent restarts it from the node's snapshot, like any crashed worker.
WEDGED_EXIT_CODE = 75

# What torch must be told before an NCCL group exists, and why.
ENV_FOR_ABORT: Mapping[str, str] = {
    # The watchdog must report a failed or aborted collective, not tear the process down.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # Nor may the heartbeat monitor kill a process whose watchdog looks stuck.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # Non-blocking communicators: init and abort return instead of waiting on a dead peer
    # (also set per group through the options where torch has them).
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
    # work.wait() makes the current stream wait; a blocking wait would hold the thread.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}


class Flavour(enum.Enum):
    """Which of torch's NCCL groups the transport builds."""

    NCCL2 = "nccl2"  # ProcessGroupNCCL2 with enable_reconfigure: abort revokes work in flight
    LEGACY = "legacy"  # ProcessGroupNCCL, non-blocking communicators, abort() from any thread


def choose_flavour(
    has_nccl2: bool, has_legacy: bool, env: Mapping[str, str]
) -> tuple[Flavour, str]:
    """The group to build, and why. ``TORCH_DIST_USE_NCCL2=0`` asks for the legacy group
    (torch's own switch, honoured the same way); else NCCL2 where torch has it."""
    if env.get("TORCH_DIST_USE_NCCL2") == "0" and has_legacy:
        return Flavour.LEGACY, "TORCH_DIST_USE_NCCL2=0 asks for the legacy ProcessGroupNCCL"
    if has_nccl2:
        return Flavour.NCCL2, "ProcessGroupNCCL2 is present: abort revokes work in flight"
    if has_legacy:
        return (
            Flavour.LEGACY,
            "this torch has no ProcessGroupNCCL2: the legacy ProcessGroupNCCL with "
            "non-blocking communicators",
        )
    raise ConfigError(
        "this torch build has no NCCL process group (torch.distributed.is_nccl_available() "
        "is False); allowed: a CUDA build of torch, or device 'cpu' (gloo)"
    )


def env_changes(env: Mapping[str, str]) -> dict[str, str]:
    """The settings of ``ENV_FOR_ABORT`` that ``env`` lacks or sets otherwise."""
    return {key: value for key, value in ENV_FOR_ABORT.items() if env.get(key) != value}


@dataclass(frozen=True)
class NcclSettings:
    """How the NCCL transport treats its communicators.

    ``abort_deadline``: after an abort, how long the communicator's work may take to end
    (and ``abort()`` to return) before the worker exits with ``WEDGED_EXIT_CODE``.
    ``poll_s``: how often a held communicator's work is looked at, and the sleep within a
    wait slice. ``high_priority_stream``: NCCL's stream priority.
    """

    abort_deadline: timedelta = timedelta(seconds=20)
    poll_s: float = 0.0005
    high_priority_stream: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.abort_deadline, timedelta) or self.abort_deadline <= timedelta(0):
            raise ConfigError(
                f"abort_deadline must be a positive timedelta, got {self.abort_deadline!r}"
            )
        poll = self.poll_s
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 0.1:
            raise ConfigError(f"poll_s must be a number of seconds in (0, 0.1], got {poll!r}")
        if not isinstance(self.high_priority_stream, bool):
            raise ConfigError(
                f"high_priority_stream must be a bool, got {self.high_priority_stream!r}"
            )


@dataclass(frozen=True)
class OptionsPlan:
    """What goes into ``ProcessGroupNCCL.Options`` for one epoch's group."""

    timeout: timedelta
    blocking: int  # NCCL's config.blocking: 0 makes init and abort non-blocking
    enable_reconfigure: bool
    high_priority_stream: bool


def plan_options(flavour: Flavour, timeout: timedelta, settings: NcclSettings) -> OptionsPlan:
    """The options of one epoch's group: always non-blocking communicators, and the
    reconfigure regime for NCCL2 (its abort then revokes work instead of killing)."""
    return OptionsPlan(
        timeout=timeout,
        blocking=0,
        enable_reconfigure=flavour is Flavour.NCCL2,
        high_priority_stream=settings.high_priority_stream,
    )


class Claim(enum.Enum):
    """What a new epoch's connect may do about the process's one NCCL communicator."""

    TAKE = "take"  # none is live: build ours
    WAIT = "wait"  # the live one is being aborted: wait for it to let go
    REFUSE = "refuse"  # the live one is in use: two would contend for the GPU


@dataclass(frozen=True)
class Holder:
    """The process's live NCCL communicator: its epoch, and whether it is being retired."""

    epoch: int
    retiring: bool


def decide_claim(holder: Holder | None, epoch: int) -> tuple[Claim, str]:
    """Whether epoch ``epoch`` may build its communicator now, and why (see `Claim`)."""
    if holder is None:
        return Claim.TAKE, "no NCCL communicator is live in this process"
    if holder.retiring:
        return Claim.WAIT, f"epoch {holder.epoch}'s NCCL communicator is still being aborted"
    return (
        Claim.REFUSE,
        f"epoch {holder.epoch}'s NCCL communicator is still live in this process; close "
        f"its communicator before building epoch {epoch}'s (one live communicator per process)",
    )


class AfterAbort(enum.Enum):
    """What to do about an aborted communicator, looked at again and again."""

    WAIT = "wait"  # its abort or its work is not over yet
    RELEASE = "release"  # both over: drop the group, free its buffers and the slot
    EXIT = "exit"  # past the deadline: the worker cannot trust this process any more


def after_abort(
    now: float,
    aborted_at: float,
    abort_returned: bool,
    work_done: bool,
    deadline: timedelta,
    epoch: int,
) -> tuple[AfterAbort, str]:
    """Decide about epoch ``epoch``'s communicator, aborted at ``aborted_at`` (same clock
    as ``now``). Its buffers stay held until its work is over; a communicator that does not
    let go within ``deadline`` means a wedged device or driver: exit and be restarted."""
    if abort_returned and work_done:
        return AfterAbort.RELEASE, f"epoch {epoch}'s NCCL communicator is aborted, its work over"
    waited = now - aborted_at
    if waited < deadline.total_seconds():
        return AfterAbort.WAIT, f"epoch {epoch}'s NCCL abort under way for {waited:.3f} s"
    stuck = "abort() has not returned" if not abort_returned else "its work has not ended"
    return (
        AfterAbort.EXIT,
        f"epoch {epoch}'s NCCL communicator did not let go within "
        f"{deadline.total_seconds():g} s of its abort ({stuck}); exiting with status "
        f"{WEDGED_EXIT_CODE} so that the agent restarts this worker from its snapshot",
    )
