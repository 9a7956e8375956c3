"""The controller a training process uses when a node agent runs it.

`keepstep.init` builds it from the environment the agent sets
(KEEPSTEP_CONTROLLER=keepstep.agent.worker.controller:controller_from_env). Every decision is
the agent's; this side only asks over the local link and caches the agent's
"change pending" flag, which the job reads at every commit.

When the worker's part in the job is over (it finished, or a membership leaves it out)
it releases its connections to the epochs' stores, so that no thread of it is still in a
store call when the interpreter exits (see `stores.release_connections`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from torch._C._distributed_c10d import Store

from keepstep.agent.node import stores
from keepstep.agent.protocol.link import LinkClient, Message
from keepstep.elastic.control import CommitRecord, Membership, Reconfiguration
from keepstep.elastic.errors import PeerLost

ADMISSION_TIMEOUT = 24 * 3600.0  # a joiner may wait for a long time; the agent bounds it
STORE_CONNECT_TIMEOUT = 3.0  # a healthy store answers in milliseconds
RELEASE_TIMEOUT = 2.0  # for threads woken from a store call to end, when the worker is done


class AgentController:
    def __init__(self, link: str, member: str, timeout: float = 30.0) -> None:
        self.member = member
        self.timeout = timeout
        self._pending = threading.Event()
        self._client = LinkClient(link, self._on_push, timeout)
        # Each epoch names the store its group rendezvouses on (hosted by one of its
        # nodes); consecutive epochs usually share it, so connections are kept.
        self._store_of: dict[int, str] = {}
        self._stores: dict[str, Store] = {}
        self._client.request("hello", timeout, member=member)

    def _on_push(self, message: Message) -> None:
        if message.get("op") == "pending":
            if message.get("value"):
                self._pending.set()
            else:
                self._pending.clear()

    def _membership(self, reply: Message) -> Membership | None:
        record = reply.get("membership")
        if record is None:
            return None
        epoch = int(record["epoch"])
        if record.get("store"):
            self._store_of[epoch] = str(record["store"])
        membership = Membership(epoch, tuple(record["members"]), self.member)
        if not membership.includes_me:
            self._release()  # the job goes on without this worker: it leaves now
        return membership

    def _release(self) -> None:
        self._stores = {}
        stores.release_connections(set(self._store_of.values()), RELEASE_TIMEOUT)

    def store(self, epoch: int) -> Store:
        address = self._store_of.get(epoch)
        if address is None:
            raise PeerLost(epoch, f"epoch {epoch} names no process-group store")
        client = self._stores.get(address)
        if client is None:
            client = _connect(epoch, address, self.timeout)
            self._stores = {address: client}  # older epochs' stores are not needed again
        return client

    def initial(self, timeout: float) -> Membership:
        reply = self._client.request("initial", ADMISSION_TIMEOUT, member=self.member)
        membership = self._membership(reply)
        assert membership is not None, "the agent answers initial with a membership"
        return membership

    def change_pending(self) -> bool:
        return self._pending.is_set()

    def poll(self, done: int, announced: bool) -> Membership | None:
        if not announced:
            return None
        reply = self._client.request("boundary", ADMISSION_TIMEOUT, member=self.member, done=done)
        return self._membership(reply)

    def on_failure(self, epoch: int, done: int, error: PeerLost, timeout: float) -> Membership:
        reply = self._client.request(
            "failure",
            ADMISSION_TIMEOUT,
            member=self.member,
            epoch=epoch,
            done=done,
            reason=error.reason,
        )
        membership = self._membership(reply)
        assert membership is not None, "the agent answers a failure with a membership"
        return membership

    def on_reconfigured(self, record: Reconfiguration) -> None:
        self._client.notify("reconfigured", member=self.member, record=_plain(record))

    def on_commit(self, record: CommitRecord) -> None:
        self._client.notify("commit", member=self.member, record=_plain(record))

    def on_finish(self, done: int, params_sha256: str) -> None:
        self._client.request(
            "finish", self.timeout, member=self.member, done=done, params_sha256=params_sha256
        )
        self._release()


def _connect(epoch: int, address: str, timeout: float) -> Store:
    """A client of the epoch's store. Connecting to a stopped node blocks with no timeout
    (the kernel accepts, nobody answers the handshake), so it runs on a thread of its own
    and a silent store is given up after `STORE_CONNECT_TIMEOUT`: the epoch is over."""
    stores.parse_address(address)  # a malformed address is a bug: say so here, not later
    box: list[Store] = []
    errors: list[RuntimeError] = []

    def connect() -> None:
        try:
            box.append(stores.connect(address, timeout))
        except RuntimeError as error:  # torch's DistNetworkError is a RuntimeError
            errors.append(error)

    thread = threading.Thread(target=connect, name=f"keepstep-store-{epoch}", daemon=True)
    thread.start()
    thread.join(min(timeout, STORE_CONNECT_TIMEOUT))
    if box:
        return box[0]
    why = f": {errors[0]}" if errors else f" within {STORE_CONNECT_TIMEOUT:.0f} s"
    raise PeerLost(epoch, f"store {address} did not answer{why}")


def _plain(record: Any) -> dict[str, Any]:
    """A record's fields for the link's JSON: tuples as lists, a mapping as a dict. Shallow:
    `dataclasses.asdict` deep-copies every field, on the training path once a step."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}
        out[f.name] = value
    return out


def controller_from_env(env: Mapping[str, str]) -> AgentController:
    return AgentController(link=env["KEEPSTEP_LINK"], member=env["KEEPSTEP_MEMBER"])
