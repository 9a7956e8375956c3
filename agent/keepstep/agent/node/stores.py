"""Process-group stores: each agent hosts one, each epoch uses its first node's.

Workers rendezvous their gloo group of epoch `e`, and watch that epoch's abort key, on a
TCP key-value store. A store in one fixed place would be a single point of failure (and
on Kubernetes there is no such place), so every agent hosts a store server and the
epoch record names the one on the epoch's first node. When that node is lost the epoch
is over anyway; the next epoch's store is on a survivor.

`StoreHost` is the server this agent owns; `StoreClients` makes the agent's own writes
(aborts) off the caller's thread, so that a dead or hung store never holds the agent up.
Both connect with `keepstep.agent.worker.stores.connect`, the client side that workers use.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

from keepstep.agent.worker.stores import connect
from keepstep.elastic.comm import abort_epoch
from keepstep.errors import KeepstepError

log = logging.getLogger("keepstep.agent")


class StoreHost:
    """The store server of this node: it lives as long as the agent does."""

    def __init__(self, host: str, port: int = 0, timeout: float = 30.0) -> None:
        try:
            # The server listens on every interface; `host` is what peers are told.
            self._server = TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout),
            )
        except RuntimeError as error:  # torch's DistNetworkError is a RuntimeError
            raise KeepstepError(
                f"cannot host the process-group store on {host}:{port}: {error}"
            ) from None
        self.host = host
        self.port = int(self._server.port)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class StoreClients:
    """The agent's own writes to the stores of epochs (aborts)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def abort(self, address: str, epoch: int, ranks: int, reason: str) -> None:
        """Write epoch `epoch`'s abort key and wake its `ranks` members, from a thread of its own.

        A store call to a stopped node blocks with no timeout at all (the kernel still
        accepts the bytes), and the caller is the agent's etcd watch: it must never wait.
        Each abort has its own connection, so one stuck on a hung store holds up nothing
        else. When the store's node is gone the workers find its store silent, which
        aborts them too.
        """
        threading.Thread(
            target=self._abort,
            args=(address, epoch, ranks, reason),
            name="keepstep-abort",
            daemon=True,
        ).start()

    def _abort(self, address: str, epoch: int, ranks: int, reason: str) -> None:
        try:
            abort_epoch(connect(address, self.timeout), epoch, reason, ranks)
        except (RuntimeError, KeepstepError) as error:
            log.warning("could not abort epoch %d at %s: %s", epoch, address, error)
