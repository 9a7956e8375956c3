"""The elastic job: the loop that survives membership changes in the same process.

`Job.steps(n)` yields `Step`s until n steps are committed. Between steps it asks the
controller for a planned change (drain, join); after a failed step it asks for the next
epoch. Entering an epoch is the data-plane half of a recovery:

    rebuild communicator -> exchange views and agree the resume step (rollback.py) ->
    restore (local snapshot, or a peer's snapshot over the network) -> replan

and each phase is timed into a `Reconfiguration` record handed back to the controller.
After each step the loop applies what `Step.commit` returned: it reports the commit,
remembers whether a planned change was announced, and retries or recovers a failed step.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import default_collate

from keepstep.elastic.comm import WATCH_TIMEOUT, Communicator
from keepstep.elastic.config import JobConfig
from keepstep.elastic.control import Controller, Membership, Reconfiguration
from keepstep.elastic.errors import ConfigError, KeepstepError, PeerLost
from keepstep.elastic.plan import plan
from keepstep.elastic.reduce import make_reducer
from keepstep.elastic.rng import SampleOrder, fix_determinism
from keepstep.elastic.rollback import VIEW_MAX_BYTES, MemberView, ResumePlan, resume_plan
from keepstep.elastic.snapshot_store import SnapshotStore
from keepstep.elastic.step import CommitResult, Step, StepOutcome
from keepstep.elastic.train_state import capture, check_layout, layout_signature, restore

log = logging.getLogger(__name__)


class Job:
    """A training job as one member sees it. Build it with `keepstep.init`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        config: JobConfig,
        controller: Controller,
        snapshots: SnapshotStore,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        fix_determinism(config.threads)
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.config = config
        self.controller = controller
        self.snapshots = snapshots
        self.collate: Callable[[list[Any]], Any] = collate or default_collate
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require grad")
        self.reducer = make_reducer(config.mode, self.params, config.n_micro)
        self.order = SampleOrder(
            config.seed, len(dataset), config.micro_batch, config.n_micro, config.shuffle
        )
        self.layout = layout_signature(model)
        self.collective_timeout = timedelta(seconds=config.collective_timeout)
        self.comm: Communicator | None = None
        self.membership: Membership | None = None
        self.assignment: dict[str, list[int]] = {}
        self.left = False
        self.reconfigurations: list[Reconfiguration] = []
        infos = snapshots.infos()
        # A restarted worker finds its node's snapshots and resumes from them; a new one
        # starts "fresh": its state counts only if no member holds a committed one.
        self.fresh = not infos
        self.done = infos[0].step if infos else 0
        self.loaded_step: int | None = None if infos else 0
        self.snapshot_s = 0.0
        if self.fresh:
            self._snapshot()

    # -- the loop ---------------------------------------------------------------------
    def steps(self, total: int | None = None) -> Iterator[Step]:
        """Yield steps until `total` are committed (or this member is drained).

        Without `total`, the launcher's step count (`JobConfig.planned_steps`) is used.
        """
        if total is None:
            total = self.config.planned_steps
            if total is None:
                raise ConfigError("job.steps() needs a step count (or a launcher that sets one)")
        if total < 0:
            raise ConfigError(f"steps={total} must be >= 0")
        if self.membership is None:
            self._switch(self.controller.initial(self.config.collective_timeout))
        retries = 0
        announced = False  # a member flagged a planned change in the step just committed
        while not self.left and self.done < total:
            change = self.controller.poll(self.done, announced)
            announced = False
            if change is not None:
                self._switch(change)
                continue
            assert self.membership is not None
            step = Step(self, self.done, self.assignment[self.membership.me])
            yield step
            result = step.result
            if result is None:
                raise ConfigError(f"step {step.index} ended without step.commit()")
            announced = result.announced
            retries = self._apply(step.index, result, retries)
        self.snapshots.wait()
        if not self.left:
            self.controller.on_finish(self.done, self.params_sha256())

    def _apply(self, index: int, result: CommitResult, retries: int) -> int:
        """Act on how step `index` ended; return the overflow retries in a row so far."""
        if result.outcome is StepOutcome.COMMITTED:
            assert result.record is not None
            self.controller.on_commit(result.record)
            return 0
        if result.outcome is StepOutcome.RETRY:
            if retries + 1 > self.config.max_overflow_retries:
                raise KeepstepError(
                    f"step {index}: gradient overflow persisted after {retries} rescaled retries"
                )
            return retries + 1
        assert result.outcome is StepOutcome.FAILED and result.failure is not None
        log.warning("step %d failed: %s", index, result.failure)
        self._switch(self._next_after(result.failure))
        return retries

    # -- committing -------------------------------------------------------------------
    def check_layout(self) -> None:
        """StateShapeError if the model's state no longer has the shapes it started with."""
        check_layout(self.layout, self.model)

    def apply_and_snapshot(self) -> None:
        """Apply the reduced gradient (already in .grad) and snapshot the new state."""
        # The previous snapshot copy reads the live tensors: it must end before they change.
        t0 = time.perf_counter()
        self.snapshots.wait()
        t1 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.done += 1
        self.loaded_step = self.done
        t2 = time.perf_counter()
        self._snapshot()
        # What the snapshot cost this step's critical path: waiting for the last copy to
        # end, and starting this one (the copy itself overlaps the next step).
        self.snapshot_s = (t1 - t0) + (time.perf_counter() - t2)

    def _snapshot(self) -> None:
        state = capture(self.done, self.model, self.optimizer, self.reducer.state_dict())
        # Buffers can change in the next forward while the copy runs; parameters and
        # optimizer slots only change in the next optimizer.step, after wait(). (The state
        # dict holds detached aliases of the parameters: their memory tells them apart.)
        params = {p.data_ptr() for p in self.model.parameters()}
        tensors = {
            k: (v if not k.startswith("model/") or v.data_ptr() in params else v.detach().clone())
            for k, v in state.tensors.items()
        }
        self.snapshots.commit(self.done, tensors, state.meta)

    @property
    def is_leader(self) -> bool:
        """True on the first member of the current epoch (for printing, once per job)."""
        m = self.membership
        return m is not None and m.includes_me and m.members[0] == m.me

    def params_sha256(self) -> str:
        """sha256 over the model's state dict, in key order: the bit-identity check."""
        digest = hashlib.sha256()
        for key, value in self.model.state_dict().items():
            digest.update(key.encode())
            digest.update(value.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    # -- entering an epoch --------------------------------------------------------------
    def _next_after(self, error: PeerLost) -> Membership:
        timeout = self.config.collective_timeout
        return self.controller.on_failure(error.epoch, self.done, error, timeout)

    def _switch(self, membership: Membership) -> None:
        """Enter `membership`; a peer lost while entering (a second fault during a
        recovery) moves on to the epoch after it, until one is entered."""
        while True:
            try:
                self._enter(membership)
                return
            except PeerLost as error:
                log.warning("entering epoch %d failed: %s", membership.epoch, error)
                membership = self._next_after(error)

    def _enter(self, membership: Membership) -> None:
        t0 = time.perf_counter()
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.membership = membership
        if not membership.includes_me:
            self.left = True
            return
        # Validate the membership against the batch before anyone waits on a rendezvous.
        plan(
            self.done,
            membership.members,
            self.config.global_batch,
            self.config.micro_batch,
            membership.weights,
        )
        # After a false alarm the agents raise the epoch's timeouts (see timeout_scale):
        # every collective of the epoch, and each read of its store, waits that much longer.
        scale = membership.timeout_scale
        self.collective_timeout = timedelta(seconds=self.config.collective_timeout) * scale
        self.comm = Communicator.create(
            self.controller.store(membership.epoch),
            membership.epoch,
            membership.members,
            membership.me,
            self.collective_timeout,
            host=self.config.host,
            store_timeout=WATCH_TIMEOUT * scale,
        )
        t1 = time.perf_counter()
        before = self.done
        received = self._agree_and_restore(self.comm)
        t2 = time.perf_counter()
        self.assignment = plan(
            self.done,
            membership.members,
            self.config.global_batch,
            self.config.micro_batch,
            membership.weights,
        )
        t3 = time.perf_counter()
        record = Reconfiguration(
            epoch=membership.epoch,
            members=membership.members,
            communicator_s=t1 - t0,
            restore_s=t2 - t1,
            replan_s=t3 - t2,
            resume_step=self.done,
            rolled_back_steps=max(0, before - self.done) if not received else 0,
            received_state=received,
        )
        self.reconfigurations.append(record)
        self.controller.on_reconfigured(record)

    def _agree_and_restore(self, comm: Communicator) -> bool:
        """Roll every member to the same committed step; return True if state came by wire."""
        self.snapshots.wait()
        mine = MemberView(self.fresh, self.done, tuple(i.step for i in self.snapshots.infos()))
        views = self._exchange(comm, mine)
        decision = resume_plan(views)
        log.info("epoch %d: %s", comm.epoch, decision.reason)
        resume = decision.resume_step
        received = self._transfer(comm, decision)
        if self.loaded_step != resume or received:
            extra = restore(self.snapshots.load(resume), self.model, self.optimizer)
            self.reducer.load_state_dict(extra)
            self.loaded_step = resume
        self.done = resume
        self.fresh = False
        return received and self.done > 0

    def _exchange(self, comm: Communicator, mine: MemberView) -> list[MemberView]:
        """Every member's view in rank order, as bounded JSON (never pickle)."""
        blobs = comm.allgather_bytes(mine.encode(), VIEW_MAX_BYTES, self.collective_timeout)
        return [MemberView.decode(blob, rank) for rank, blob in enumerate(blobs)]

    def _transfer(self, comm: Communicator, decision: ResumePlan) -> bool:
        """Send the source's snapshot of the resume step to the needy; True if it came here."""
        if not decision.needy:
            return False
        source = decision.source
        blob = self.snapshots.export(decision.resume_step) if comm.rank == source else b""
        size = torch.tensor([len(blob)], dtype=torch.int64)
        comm.broadcast(size, source, self.collective_timeout)
        wire = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if comm.rank == source
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        comm.broadcast(wire, source, self.collective_timeout)
        if comm.rank not in decision.needy:
            return False
        self.snapshots.import_(wire.numpy().tobytes())
        return True
