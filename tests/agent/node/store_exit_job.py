"""A process left with a thread in a store call when it exits (test_worker_exits).

    python store_exit_job.py keep|release

It gives up an epoch whose rendezvous waits for a member that never comes (the group
build goes on in a thread, blocked in a store call), then exits; while the interpreter
shuts down, the store's node goes away. With "release" it first calls
`stores.release_connections`, as a worker does when its part in the job is over.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import TCPStore

from keepstep.agent.worker import stores
from keepstep.elastic.comm import Communicator, abort_epoch
from keepstep.elastic.errors import PeerLost


class StoreNodeExits:
    """Dropped in module teardown, after the interpreter began finalizing: the store
    goes away, and the thread blocked on it wakes while this waits."""

    def __init__(self, host: TCPStore) -> None:
        self.host: TCPStore | None = host

    def __del__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self.host = None
        sleep(1.0)


def main() -> StoreNodeExits:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{host.port}"
    abort_epoch(host, 0, "given up", 2)  # the epoch is over before it began
    try:
        Communicator.create(
            stores.connect(address, 30.0), 0, ["a", "b"], "a", timedelta(seconds=30)
        )
    except PeerLost:
        pass
    if sys.argv[1] == "release":
        print("released", stores.release_connections([address], 2.0), flush=True)
    return StoreNodeExits(host)


if __name__ == "__main__":
    keeper = main()
