"""Building the gloo group of one epoch, with the epoch's agreed parameters checked first.

Where it sits: called by `Communicator.create` (communicator.py) once the agents agreed on
epoch ``e`` and its sorted members. torch's default process group is never touched: each
epoch is a private ``ProcessGroupGloo`` on the store prefix ``keepstep/epoch-{e}/``. The
group's constructor blocks until every member connected, so it runs on a thread
(`GroupBuild`) while the caller waits on the epoch's `AbortWatch`: a member that died
before joining is heard at once, not after the group timeout.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
from torch._C._distributed_c10d import PrefixStore, Store

from keepstep.elastic.comm.abort import check_epoch, short_reason
from keepstep.elastic.comm.watch import AbortWatch, Outcome
from keepstep.elastic.errors import ConfigError, PeerLost


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


class GroupBuild:
    """The epoch's gloo group, being built on a thread of its own from construction on.

    Start it before the epoch's `AbortWatch`: its store connection then opens while the
    watch's do, ahead of any abort the watch can hear. A worker that leaves at once after
    an abort releases its store connections; one still being opened then escapes the
    release, and its rendezvous wakes in the finalizing interpreter (SIGABRT).
    """

    def __init__(self, store: Store, spec: EpochSpec) -> None:
        self._spec = spec
        self._box: list[Any] = []
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
            self._box.append(_new_gloo_group(store, self._spec))
        except Exception as err:
            self._errors.append(err)
        finally:
            self._built.set()

    def result(self, watch: AbortWatch) -> Any:
        """The group, once every member joined; ``PeerLost`` if the epoch is aborted (heard
        through ``watch``) or the spec's timeout passes first."""
        spec, built = self._spec, self._built
        outcome = watch.wait(lambda ms: built.wait(ms / 1000), self._deadline, threading.Event())
        if outcome is Outcome.DONE and self._box:
            return self._box[0]
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
        raise PeerLost(spec.epoch, reason)


def _new_gloo_group(store: Store, spec: EpochSpec) -> Any:
    # The stubs declare `Options.devices`; the runtime class is `_Options` with `_devices`
    # (what distributed_c10d uses itself), hence Any.
    gloo = cast(Any, dist.ProcessGroupGloo)
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname=spec.host)]
    opts._timeout = spec.timeout
    # Each group rendezvouses over its own store connection: the group of an abandoned
    # epoch can still be blocked in a store wait for a dead member, and on a shared
    # connection that wait would hold up the next epoch's rendezvous until it times out.
    try:
        own = store.clone()
    except (RuntimeError, NotImplementedError):
        own = store
    prefixed = PrefixStore(f"keepstep/epoch-{spec.epoch}/", own)
    return gloo(prefixed, spec.rank, spec.size, opts)
