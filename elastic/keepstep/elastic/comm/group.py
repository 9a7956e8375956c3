"""Building the group of one epoch, with the epoch's agreed parameters checked first.

Where it sits: called by `Communicator.create` (communicator.py) once the agents agreed on
epoch ``e`` and its sorted members. The transport (gloo.py or nccl.py, behind the seam of
transport.py) builds the epoch's private group; torch's default process group is never
touched. Building blocks until every member connected, so it runs on a thread
(`GroupBuild`) while the caller waits on the epoch's `AbortWatch`: a member that died
before joining is heard at once, not after the group timeout. A group that arrives after
the caller gave up is retired at once (an NCCL communicator must not stay live).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import PrefixStore, Store

from keepstep.elastic.comm.abort import check_epoch, short_reason
from keepstep.elastic.comm.watch import AbortWatch, Outcome
from keepstep.elastic.errors import ConfigError, PeerLost

if TYPE_CHECKING:
    from keepstep.elastic.comm.transport import Link, Transport


def check_timeout(timeout: timedelta) -> None:
    """ConfigError unless ``timeout`` is a positive timedelta."""
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ConfigError(f"timeout must be a positive timedelta, got {timeout!r}")


@dataclass(frozen=True)
class EpochSpec:
    """What every member of an epoch agrees on, validated before anything connects."""

    epoch: int
    members: tuple[str, ...]
    me: str
    timeout: timedelta
    host: str

    def __post_init__(self) -> None:
        check_epoch(self.epoch)
        names = self.members
        if not names:
            raise ConfigError("members must not be empty")
        if not all(isinstance(name, str) and name for name in names):
            raise ConfigError(f"every member must be a non-empty str, got {list(names)!r}")
        if list(names) != sorted(set(names)):
            raise ConfigError(f"members must be sorted and unique, got {list(names)!r}")
        if self.me not in names:
            raise ConfigError(f"me={self.me!r} is not one of members {list(names)!r}")
        check_timeout(self.timeout)
        if not self.host:
            raise ConfigError("host must be a non-empty address or hostname, got ''")

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)


def own_prefix(store: Store, epoch: int) -> Store:
    """The epoch's prefix of ``store`` (``keepstep/epoch-{e}/``), on a connection of its own.

    Each group rendezvouses over its own store connection: the group of an abandoned epoch
    can still be blocked in a store wait for a dead member, and on a shared connection that
    wait would hold up the next epoch's rendezvous until it times out.
    """
    try:
        own = store.clone()
    except (RuntimeError, NotImplementedError):
        own = store
    return PrefixStore(f"keepstep/epoch-{epoch}/", own)


class GroupBuild:
    """The epoch's group, being built on a thread of its own from construction on.

    Start it before the epoch's `AbortWatch`: its store connection then opens while the
    watch's do, ahead of any abort the watch can hear. A worker that leaves at once after
    an abort releases its store connections; one still being opened then escapes the
    release, and its rendezvous wakes in the finalizing interpreter (SIGABRT).
    """

    def __init__(self, store: Store, spec: EpochSpec, transport: Transport) -> None:
        self._spec = spec
        self._transport = transport
        self._lock = threading.Lock()
        self._link: Link | None = None
        self._abandoned = False
        self._errors: list[Exception] = []
        self._built = threading.Event()
        # Named so that a worker leaving the job can find it still in a store call (the
        # rendezvous of a given-up epoch) and release its connection before exiting.
        threading.Thread(
            target=self._build, args=(store,), name=f"keepstep-build-{spec.epoch}", daemon=True
        ).start()
        self._deadline = time.monotonic() + spec.timeout.total_seconds()

    def _build(self, store: Store) -> None:
        try:
            link = self._transport.connect(store, self._spec)
        except Exception as err:
            self._errors.append(err)
        else:
            with self._lock:
                late = self._abandoned
                if not late:
                    self._link = link
            if late:
                link.retire(None)  # nobody will use it: let it go now
            # This thread ends after the caller took the link: it must not hold it then
            # (see communicator._interrupter: a group's last reference dropped by a thread
            # that ends as the interpreter finalizes kills the process).
            del link
        finally:
            self._built.set()

    def result(self, watch: AbortWatch) -> Link:
        """The link, once every member joined; ``PeerLost`` if the epoch is aborted (heard
        through ``watch``) or the spec's timeout passes first."""
        spec, built = self._spec, self._built
        outcome = watch.wait(lambda ms: built.wait(ms / 1000), self._deadline, threading.Event())
        with self._lock:
            link, self._link = self._link, None  # the build thread keeps no reference
            if not (outcome is Outcome.DONE and link is not None):
                self._abandoned = True
        if outcome is Outcome.DONE and link is not None:
            return link
        if link is not None:
            link.retire(None)  # built in the very slice the epoch was given up
        if outcome is Outcome.ABORTED:
            reason = cast(str, watch.reason)
        else:
            errors = self._errors
            why = (
                f"failed: {short_reason(errors[0])}"
                if errors
                else f"timed out after {spec.timeout}"
            )
            reason = watch.fire(f"rank {spec.rank}: building the group {why}")
            if errors and isinstance(errors[0], ConfigError):
                # A local mistake (an NCCL communicator never closed): the others give the
                # epoch up at once, and this caller learns what to fix.
                raise errors[0] from PeerLost(spec.epoch, reason)
        raise PeerLost(spec.epoch, reason)
