"""A scripted member whose job ends at a failure the schedule has no epoch for, while a
thread of its group build is still in a store call (test_local_exit).

    python schedule_exit_job.py release|keep

It gives up an epoch whose rendezvous waits for a member that never comes, hands the
failure to the local launcher's controller (which raises it: the schedule has one epoch),
and dies of the error; while the interpreter shuts down, the store goes away. "keep"
clears the store address the launcher sets, so the controller releases nothing.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import PrefixStore, TCPStore

from keepstep.elastic.comm import Communicator, abort_epoch
from keepstep.elastic.errors import PeerLost
from keepstep.launch.local import controller_from_env

TOKEN = "0123abcd"


class StoreGoes:
    """Dropped in module teardown, after the interpreter began finalizing: the store goes
    away, and a thread still blocked on it wakes while this waits."""

    def __init__(self, host: TCPStore) -> None:
        self.host: TCPStore | None = host

    def __del__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self.host = None
        sleep(1.0)


KEEPER: list[StoreGoes] = []


def main(mode: str) -> None:
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    KEEPER.append(StoreGoes(host))
    env = {
        "KEEPSTEP_STORE": f"127.0.0.1:{host.port}",
        "KEEPSTEP_STORE_TOKEN": TOKEN,
        "KEEPSTEP_SCHEDULE": json.dumps({"schedule": [["a", "b"]], "at_step": [0]}),
        "KEEPSTEP_MEMBER": "a",
    }
    controller = controller_from_env(env)
    if mode == "keep":
        controller.store_address = ""
    membership = controller.initial(10.0)
    abort_epoch(PrefixStore(TOKEN, host), 0, "given up", 2)  # over before it began
    try:
        Communicator.create(controller.store(0), 0, membership.members, "a", timedelta(seconds=30))
    except PeerLost as lost:
        print("lost", lost.reason, flush=True)
        controller.on_failure(0, 0, lost, 10.0)  # no epoch 1: raises, and the job ends
    raise AssertionError("the build of an aborted epoch succeeded")


if __name__ == "__main__":
    main(sys.argv[1])
