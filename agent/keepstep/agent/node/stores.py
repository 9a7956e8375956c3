"""Process-group stores: each agent hosts one, each epoch uses its first node's.

Workers rendezvous their gloo group of epoch `e`, and watch that epoch's abort key, on a
TCP key-value store. A store in one fixed place would be a single point of failure (and
on Kubernetes there is no such place), so every agent hosts a store server and the
epoch record names the one on the epoch's first node. When that node is lost the epoch
is over anyway; the next epoch's store is on a survivor.

`StoreHost` is the server this agent owns; `StoreClients` makes the agent's own writes
(aborts) off the caller's thread, so that a dead or hung store never holds the agent up.
Both connect with `keepstep.agent.worker.stores.connect`, the client side that workers use.

Who may steer an epoch through its store: the server has no authentication (torch's
TCPStore has none), so two things keep other processes out. It listens only on the
node's address (the one peers are told), not on every interface. And every key an epoch
writes lives under the epoch's secret prefix (`EpochRecord.token`, `stores.for_epoch`):
a process that reaches the port without the job's records cannot name any of them.
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

from keepstep.agent.protocol import EpochRecord
from keepstep.errors import KeepstepError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

log = logging.getLogger("keepstep.agent")


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to `host` alone (the first address it resolves to).

    torch's TCPStore server, given no socket, binds the wildcard address (every
    interface, IPv6 and IPv4) whatever host it is told; given one (`master_listen_fd`), its
    libuv server listens on it as it is. So the agent binds the socket itself.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise KeepstepError(
            f"cannot host the process-group store on {host}:{port}: {error}"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError as error:
        sock.close()
        raise KeepstepError(
            f"cannot host the process-group store on {host}:{port}: {error}"
        ) from None
    return sock


class StoreHost:
    """The store server of this node: it lives as long as the agent does.

    Its socket is bound at once (the node's record names its port); the server on it
    starts in `serve`, which imports torch. The agent starts its workers between the two,
    so that their imports of torch and its own run side by side. A client that connects
    before `serve` waits in the socket's backlog."""

    def __init__(self, host: str, port: int = 0, timeout: float = 30.0) -> None:
        self._sock: socket.socket | None = listen(host, port)
        self._server: TCPStore | None = None
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        self.timeout = timeout

    def serve(self) -> None:
        """Start the server on the bound socket (once)."""
        if self._server is not None:
            return
        from torch._C._distributed_c10d import TCPStore

        sock = self._sock
        assert sock is not None, "a store that failed to start is not started again"
        self._sock = None
        try:
            self._server = TCPStore(
                self.host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.timeout),
                master_listen_fd=sock.fileno(),
                use_libuv=True,  # the server that takes the socket as it is bound
            )
        except RuntimeError as error:  # torch's DistNetworkError is a RuntimeError
            sock.close()
            raise KeepstepError(
                f"cannot host the process-group store on {self.address}: {error}"
            ) from None
        sock.detach()  # the server owns the descriptor now, and closes it

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class StoreClients:
    """The agent's own writes to the stores of epochs (aborts)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def abort(self, address: str, epoch: int, ranks: int, reason: str, token: str = "") -> None:
        """Write epoch `epoch`'s abort key and wake its `ranks` members, from a thread of its own.

        `token` is the epoch's key prefix (`EpochRecord.token`): the keys its members watch.
        A store call to a stopped node blocks with no timeout at all (the kernel still
        accepts the bytes), and the caller is the agent's etcd watch: it must never wait.
        Each abort has its own connection, so one stuck on a hung store holds up nothing
        else. When the store's node is gone the workers find its store silent, which
        aborts them too.
        """
        threading.Thread(
            target=self._abort,
            args=(address, epoch, ranks, reason, token),
            name="keepstep-abort",
            daemon=True,
        ).start()

    def end(self, epoch: EpochRecord, reason: str) -> None:
        """`abort` the rendezvous and collectives of `epoch`, wherever its store is."""
        if epoch.store:
            self.abort(epoch.store, epoch.epoch, len(epoch.members), reason, epoch.token)

    def _abort(self, address: str, epoch: int, ranks: int, reason: str, token: str) -> None:
        from keepstep.agent.worker.stores import connect, for_epoch  # torch
        from keepstep.elastic.comm import abort_epoch

        try:
            store = for_epoch(connect(address, self.timeout), token)
            abort_epoch(store, epoch, reason, ranks)
        except (RuntimeError, KeepstepError) as error:
            log.warning("could not abort epoch %d at %s: %s", epoch, address, error)
