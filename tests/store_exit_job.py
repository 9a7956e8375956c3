"""A process left with a thread in a store call when it exits (test_worker_exits,
test_local_exit).

    python store_exit_job.py worker|schedule keep|release

It gives up an epoch whose rendezvous waits for a member that never comes (the group
build goes on in a thread, blocked in a store call), then exits; while the interpreter
shuts down, the store's node goes away.
- worker: it exits normally; "release" first calls `stores.release_connections`, as a
  worker does when its part in the job is over.
- schedule: it hands the failure to the local launcher's controller, which raises it (the
  schedule has one epoch), and dies of the error; "keep" clears the store address the
  launcher sets, so the controller releases nothing.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, TCPStore

from keepstep.agent.worker import stores
from keepstep.elastic.comm import Communicator, abort_epoch
from keepstep.elastic.errors import PeerLost
from keepstep.launch.local import controller_from_env

TOKEN = "0123abcd"  # the schedule's epoch prefix


class StoreNodeExits:
    """Dropped in module teardown, after the interpreter began finalizing: the store
    goes away, and the thread blocked on it wakes while this waits."""

    def __init__(self, host: TCPStore) -> None:
        self.host: TCPStore | None = host

    def __del__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self.host = None
        sleep(1.0)


KEEPER: list[StoreNodeExits] = []


def worker(host: TCPStore, address: str, release: bool) -> None:
    abort_epoch(host, 0, "given up", 2)  # the epoch is over before it began
    try:
        Communicator.create(
            stores.connect(address, 30.0), 0, ["a", "b"], "a", timedelta(seconds=30)
        )
    except PeerLost:
        pass
    if release:
        print("released", stores.release_connections([address], 2.0), flush=True)


def schedule(host: TCPStore, address: str, release: bool) -> None:
    env = {
        "KEEPSTEP_STORE": address,
        "KEEPSTEP_STORE_TOKEN": TOKEN,
        "KEEPSTEP_SCHEDULE": json.dumps({"schedule": [["a", "b"]], "at_step": [0]}),
        "KEEPSTEP_MEMBER": "a",
    }
    controller = controller_from_env(env)
    if not release:
        controller.store_address = ""
    membership = controller.initial(10.0)
    abort_epoch(PrefixStore(TOKEN, host), 0, "given up", 2)
    try:
        Communicator.create(controller.store(0), 0, membership.members, "a", timedelta(seconds=30))
    except PeerLost as lost:
        print("lost", lost.reason, flush=True)
        controller.on_failure(0, 0, lost, 10.0)  # no epoch 1: raises, and the job ends
    raise AssertionError("the build of an aborted epoch succeeded")


def main(how: str, mode: str) -> None:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    KEEPER.append(StoreNodeExits(host))
    scenario = {"worker": worker, "schedule": schedule}[how]
    scenario(host, f"127.0.0.1:{host.port}", mode == "release")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
