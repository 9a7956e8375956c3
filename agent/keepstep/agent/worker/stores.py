"""Connections to the process-group stores, from inside a training process.

Workers rendezvous their gloo group of epoch `e`, and watch that epoch's abort key, on the
TCP store the epoch record names (hosted by one of the epoch's node agents; see
`keepstep.agent.node.stores`). `connect` makes a client; `for_epoch` is the view of it that
an epoch's members use (every key under the epoch's secret prefix, its `token`);
`release_connections` shuts a worker's connections down when its part in the job is over.
The node agent uses the same `connect` and `for_epoch` for its own writes (aborts).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import threading
import time
from collections.abc import Collection
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from keepstep.elastic.comm.exit_guard import EXIT_GUARD
from keepstep.errors import KeepstepError


def parse_address(address: str) -> tuple[str, int]:
    """`host:port` (IPv6 hosts in brackets) -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KeepstepError(f"store address {address!r} must look like 'host:port'")
    return host.strip("[]"), int(port)


def connect(address: str, timeout: float) -> Store:
    """A client of the store at `address`; `timeout` bounds connecting and every call."""
    host, port = parse_address(address)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def for_epoch(client: Store, token: str) -> Store:
    """The store as epoch members see it: every key under the epoch's `token`.

    A store server has no authentication and no key listing: a process that can reach its
    port, but has not read the epoch's record, cannot name any key of the epoch (the gloo
    rendezvous, the abort and wake keys), so it can neither read them nor steer the epoch
    (a forged abort key lands beside the real one, which nobody watches). An empty token
    (a record from before tokens) means no prefix. Clones (each thread's own connection)
    keep the prefix.
    """
    return PrefixStore(token, client) if token else client


# Threads of this process that may sit in a store call (named by keepstep.elastic.comm
# and worker_link): a group's rendezvous, a connection attempt.
_STORE_THREADS = ("keepstep-build-", "keepstep-store-")


def release_connections(addresses: Collection[str], timeout: float) -> int:
    """Shut down this process's connections to the stores at `addresses`; return how many.

    A worker calls this when its part in the job is over. A thread still blocked in a
    store call (the rendezvous of an epoch that was given up, waiting on a member that
    never came) would otherwise wake while the interpreter shuts down, when its store's
    node exits or its timeout ends, and a thread that wakes then kills the process with
    SIGABRT ("terminate called without an active exception"). With its connection shut
    down it wakes now, fails, and ends; this waits up to `timeout` for such threads.
    Linux only (it finds the sockets in /proc/self/fd); elsewhere it does nothing.
    """
    deadline = time.monotonic() + timeout
    peers = {peer for address in addresses for peer in _resolve(address)}
    if not os.path.isdir("/proc/self/fd"):
        return 0
    done: set[int] = set()
    released = _shut_down(peers, done)
    # A store thread may open its connection only now (a group build that a loaded
    # machine started late, or an abort watch's thread still connecting: the launcher's
    # store, held up by a member's exit, kept such a clone waiting past the exit guard's
    # wait, and it returned while the interpreter finalized). Shut down what appears until
    # every such thread has ended and no watch thread is in a store call.
    while time.monotonic() < deadline:
        waiting = _store_threads()
        if waiting:
            waiting[0].join(min(RESCAN_S, max(deadline - time.monotonic(), 0.0)))
        elif EXIT_GUARD.calls.busy:
            time.sleep(min(RESCAN_S, max(deadline - time.monotonic(), 0.0)))
        else:
            break
        released += _shut_down(peers, done)
    return released


RESCAN_S = 0.05  # how often a release looks again for connections opened meanwhile


def _store_threads() -> list[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t.name.startswith(_STORE_THREADS) and t is not me]


def _shut_down(peers: set[tuple[str, int]], done: set[int]) -> int:
    """Shut down every connected stream socket of this process whose peer is in `peers`
    and whose inode is not in `done` (those shut down before), adding theirs to it."""
    released = 0
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            info = os.fstat(fd)
            if not stat.S_ISSOCK(info.st_mode) or info.st_ino in done:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
        with sock:
            try:
                if sock.type == socket.SOCK_STREAM and _peer(sock) in peers:
                    sock.shutdown(socket.SHUT_RDWR)  # the socket itself, not only this copy
                    done.add(info.st_ino)
                    released += 1
            except OSError:
                continue  # not connected (shut down before), or not an internet socket
    return released


def _resolve(address: str) -> set[tuple[str, int]]:
    host, port = parse_address(address)
    try:
        ips = {str(ipaddress.ip_address(host))}
    except ValueError:  # a name: what it resolves to is what the sockets are connected to
        try:
            ips = {str(info[4][0]) for info in socket.getaddrinfo(host, port)}
        except OSError:
            return set()
    return {(_plain_ip(ip), port) for ip in ips}


def _peer(sock: socket.socket) -> tuple[str, int] | None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    name = sock.getpeername()
    return _plain_ip(str(name[0])), int(name[1])


def _plain_ip(ip: str) -> str:
    """c10d connects over IPv6 sockets: an IPv4 peer shows as ::ffff:a.b.c.d."""
    parsed = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)
