"""The controller a training process uses when a node agent runs it.

`keepstep.init` builds it from the environment the agent sets
(KEEPSTEP_CONTROLLER=keepstep.agent.worker.controller:controller_from_env). Every decision is
the agent's; this side only asks over the local link (`link_client`, typed messages) and
caches the agent's "change pending" flag, which the job reads at every commit, and the
steps of the job's closed step gates: at a boundary where it has committed one of them, the
worker holds (`Hold`) until the agent says the gate is open, so that a fault scheduled at
that step is injected while the job stands exactly there (`agent/node/gates`).

Every question has its bound (`AnswerBounds`, set by the agent from its own bounds): an
agent that stays silent past it is wedged, and the worker raises AgentUnresponsive rather
than hang; an agent that gives up (no admission in time, too few members left) answers
with the error's type. A worker the next epoch leaves out (`Excluded`) asks again to be
admitted, under the admission bound, which is long: it may have to wait for a boundary.

The store an epoch's group gets (`store`) is the epoch's view of its store server: every
key under the epoch's secret prefix from the membership (`stores.for_epoch`), so that the
library's rendezvous, abort and wake keys are out of reach of anyone who did not get the
epoch from an agent.

When the worker's part in the job is over (it finished, a membership leaves it out, or
the agent answers its failure with an error that ends the job) it releases its
connections to the epochs' stores, so that no thread of it is still in a store call when
the interpreter exits (see `stores.release_connections`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from torch._C._distributed_c10d import Store

from keepstep.agent.protocol.link import AnswerBounds
from keepstep.agent.protocol.messages import (
    AgentError,
    Boundary,
    Commit,
    ErrorCode,
    Excluded,
    Failure,
    Finish,
    GatesPush,
    Hello,
    Hold,
    Initial,
    MembershipReply,
    Message,
    NoChange,
    PendingPush,
    Reconfigured,
    Reply,
    SlowDrain,
)
from keepstep.agent.worker import stores
from keepstep.agent.worker.link_client import LinkClient
from keepstep.elastic.control import CommitRecord, Fallback, Membership, Reconfiguration
from keepstep.elastic.errors import PeerLost
from keepstep.elastic.slow_drain import DrainRequest

STORE_CONNECT_TIMEOUT = 3.0  # a healthy store answers in milliseconds
RELEASE_TIMEOUT = 2.0  # for threads woken from a store call to end, when the worker is done


class AgentController:
    def __init__(
        self,
        link: str,
        member: str,
        timeout: float = 30.0,
        bounds: AnswerBounds | None = None,
    ) -> None:
        """`timeout` bounds the store clients' calls; `bounds` the agent's answers."""
        self.member = member
        self.timeout = timeout
        self.bounds = bounds or AnswerBounds()
        self._pending = threading.Event()
        self._gates_lock = threading.Lock()
        self._gates: tuple[int, ...] = ()  # steps of the closed gates (the agent's last push)
        self._client = LinkClient(link, self._on_push, self.bounds.reply)
        # Each epoch names the store its group rendezvouses on (hosted by one of its
        # nodes); consecutive epochs usually share it, so connections are kept.
        self._store_of: dict[int, str] = {}
        self._scale_of: dict[int, float] = {}  # each epoch's timeout_scale
        self._token_of: dict[int, str] = {}  # each epoch's key prefix in its store
        self._stores: dict[str, Store] = {}
        self._client.request(Hello(member), self.bounds.reply)

    def _on_push(self, message: Message) -> None:
        if isinstance(message, PendingPush):
            if message.pending:
                self._pending.set()
            else:
                self._pending.clear()
        elif isinstance(message, GatesPush):
            with self._gates_lock:
                self._gates = message.steps

    def _membership(self, reply: Reply) -> Membership | None:
        """The membership a reply names (None: no change at this boundary). An exclusion
        turns into a request to be admitted again."""
        if isinstance(reply, Excluded):
            reply = self._client.request(Initial(self.member), self.bounds.admission)
        if isinstance(reply, NoChange):
            return None
        if not isinstance(reply, MembershipReply):
            raise AgentError(ErrorCode.FAILED, f"unexpected answer {reply.OP.value!r}")
        if reply.store:
            self._store_of[reply.epoch] = reply.store
            self._token_of[reply.epoch] = reply.token
        self._scale_of[reply.epoch] = reply.timeout_scale
        fallback = None
        if reply.checkpoint_step >= 0:  # every member resumes from the durable checkpoint
            fallback = Fallback(reply.checkpoint_step, reply.checkpoint)
        membership = Membership(
            reply.epoch,
            reply.members,
            self.member,
            timeout_scale=reply.timeout_scale,
            fallback=fallback,
        )
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
            client = _connect(epoch, address, self.timeout, self._scale_of.get(epoch, 1.0))
            self._stores = {address: client}  # older epochs' stores are not needed again
        return stores.for_epoch(client, self._token_of.get(epoch, ""))

    def initial(self, timeout: float) -> Membership:
        # The agent bounds admission itself (a joiner may wait long for a boundary), so
        # the library's collective timeout does not apply here.
        reply = self._client.request(Initial(self.member), self.bounds.admission)
        membership = self._membership(reply)
        assert membership is not None, "the agent answers initial with a membership"
        return membership

    def change_pending(self) -> bool:
        return self._pending.is_set()

    def poll(self, done: int, announced: bool) -> Membership | None:
        self._hold(done)
        if not announced:
            return None
        reply = self._client.request(Boundary(self.member, done), self.bounds.decision)
        return self._membership(reply)

    def _hold(self, done: int) -> None:
        """Wait at a closed step gate the job has reached (`done` steps committed). The
        agent answers once every such gate is open; the push that says so may come after
        the answer, so the steps passed are dropped here."""
        with self._gates_lock:
            due = any(step <= done for step in self._gates)
        if not due:
            return
        self._client.request(Hold(self.member, done), self.bounds.decision)
        with self._gates_lock:
            self._gates = tuple(step for step in self._gates if step > done)

    def on_failure(self, epoch: int, done: int, error: PeerLost, timeout: float) -> Membership:
        request = Failure(self.member, epoch, done, error.reason, error.missing_state)
        # Missing state: the agents wait (their `missing_state_wait`) for a worker to admit.
        bound = self.bounds.admission if error.missing_state else self.bounds.decision
        try:
            reply = self._client.request(request, bound)
        except Exception:
            self._release()  # the agent gave the job up (or is wedged): this worker ends
            raise
        membership = self._membership(reply)
        assert membership is not None, "the agent answers a failure with a membership"
        return membership

    def on_reconfigured(self, record: Reconfiguration) -> None:
        self._client.report(
            Reconfigured(
                member=self.member,
                epoch=record.epoch,
                members=tuple(record.members),
                communicator_s=record.communicator_s,
                restore_s=record.restore_s,
                replan_s=record.replan_s,
                resume_step=record.resume_step,
                rolled_back_steps=record.rolled_back_steps,
                received_state=record.received_state,
                reshard_s=record.reshard_s,
                reshard_bytes=record.reshard_bytes,
            )
        )

    def on_commit(self, record: CommitRecord) -> None:
        self._client.report(
            Commit(
                member=self.member,
                step=record.step,
                epoch=record.epoch,
                world_size=record.world_size,
                micro_batches=tuple(record.micro_batches),
                samples=tuple(record.samples),
                step_s=record.step_s,
                assignment={k: tuple(v) for k, v in record.assignment.items()},
                snapshot_s=record.snapshot_s,
                skipped=record.skipped,
                metrics=dict(record.metrics),
                compute_s=record.compute_s,
                new_weights=dict(record.new_weights),
            )
        )

    def request_drain(self, request: DrainRequest) -> None:
        # A report: the agent decides (and records) whether the node goes; the step goes on.
        self._client.report(
            SlowDrain(self.member, request.epoch, request.step, request.ratio, request.reason)
        )

    def on_finish(self, done: int, params_sha256: str) -> None:
        self._client.request(Finish(self.member, done, params_sha256), self.bounds.reply)
        self._release()

    def close(self) -> None:
        """Close the link (a worker's closes with its process; tests close it early)."""
        self._client.close()


def _connect(epoch: int, address: str, timeout: float, scale: float) -> Store:
    """A client of the epoch's store. Connecting to a stopped node blocks with no timeout
    (the kernel accepts, nobody answers the handshake), so it runs on a thread of its own
    and a silent store is given up after `STORE_CONNECT_TIMEOUT` (x the epoch's
    `timeout_scale`): the epoch is over."""
    bound = STORE_CONNECT_TIMEOUT * scale
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
    thread.join(min(timeout, bound))
    if box:
        return box[0]
    why = f": {errors[0]}" if errors else f" within {bound:g} s"
    raise PeerLost(epoch, f"store {address} did not answer{why}")


def controller_from_env(env: Mapping[str, str]) -> AgentController:
    return AgentController(
        link=env["KEEPSTEP_LINK"],
        member=env["KEEPSTEP_MEMBER"],
        bounds=AnswerBounds.from_env(env),
    )
