"""The chaos injector's step gates: its faults at a step land at that step.

Where it sits: the `Injector` (inject.py) arms one gate per step-triggered fault of its
list in the run's etcd (`launch.gates`, as the launcher does for its own faults) once the
agents' configuration shows where etcd is and with which credentials. The agents hold the
job at the gate's boundary; `claims` hands the injector each held gate (and, late, each one
the job passed unheld) with the fault it is for; the injector acts and `release`s it.
Where no gate can be armed (no etcd access, as in cluster mode), `gated` stays empty and
the injector falls back to the event logs.
"""

from __future__ import annotations

import logging
import threading

from keepstep.agent.kv import KVError
from keepstep.agent.kv.etcd import EtcdCredentials, EtcdKV
from keepstep.chaos.rundir import RunView
from keepstep.errors import KeepstepError
from keepstep.launch.gates import Claimed, GateClient

log = logging.getLogger("keepstep.chaos")

GATE_OWNER = "chaos"  # the injector's gates are named chaos-<fault index>


class InjectorGates:
    def __init__(self) -> None:
        self.client: GateClient | None = None
        self.gated: set[int] = set()  # indices of the faults a gate fires
        self._tried = False

    @property
    def wake(self) -> threading.Event | None:
        return self.client.wake if self.client is not None else None

    def arm(self, view: RunView, steps: list[tuple[int, int]]) -> None:
        """Arm a gate per (fault index, step), once the agents' configuration is written.
        One attempt: if etcd refuses, step faults stay due by the event logs."""
        if self._tried or not steps:
            return
        access = view.etcd_access()
        if access is None:
            return
        self._tried = True
        job, endpoint, tls = access
        try:
            kv = EtcdKV(endpoint, credentials=EtcdCredentials.from_dir(tls) if tls else None)
        except (KeepstepError, OSError) as error:
            log.warning("chaos: no step gates (etcd client: %s)", error)
            return
        client = GateClient(kv, job, GATE_OWNER)
        try:
            client.arm((str(index), step) for index, step in steps)
        except KVError as error:
            log.warning("chaos: no step gates (%s): step faults are due by the event logs", error)
            client.close()
            kv.close()
            return
        self.client = client
        self.gated = {index for index, _ in steps}

    def claims(self, seen_step: int) -> list[tuple[int, Claimed]]:
        """The gates held now, and those the job passed unheld (`seen_step` committed), as
        (fault index, claim); each must be released."""
        if self.client is None:
            return []
        claimed = [*self.client.ready(), *self.client.passed(seen_step)]
        return [(int(c.name.rpartition("-")[2]), c) for c in claimed]

    def release(self, claimed: Claimed) -> None:
        if self.client is not None:
            self.client.release(claimed)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client.kv.close()
