"""Entering a membership epoch: the data-plane half of a recovery, for one member.

Where it sits: ``Job._switch`` (job.py) calls ``enter`` for the first epoch, for a
planned change (drain, join) and after a failed step; a ``PeerLost`` raised in here (a
second fault during a recovery) makes it ask for the epoch after.

    close the old communicator -> build this epoch's (gloo, or NCCL for CUDA parameters)
      -> exchange views and agree the resume step (rollback.py, transfer.py)
      -> restore (local snapshot, or a peer's over the network; ZeRO: the epoch's shards)
      -> replan (balance.py) and size the reduction's caller slots

Each phase is timed into the ``Reconfiguration`` record handed to the controller.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from keepstep.elastic.comm import WATCH_TIMEOUT, Communicator
from keepstep.elastic.control import Membership, Reconfiguration
from keepstep.elastic.errors import PeerLost, StateMissing
from keepstep.elastic.numerics import model_kernels
from keepstep.elastic.rollback import MemberView, fall_back, resume_plan
from keepstep.elastic.shard_figures import shard_figures
from keepstep.elastic.train_state import restore
from keepstep.elastic.transfer import exchange_views, snapshot_limit, transfer_snapshot

if TYPE_CHECKING:
    from keepstep.elastic.job import Job

log = logging.getLogger(__name__)

__all__ = ["enter"]


def enter(job: Job, membership: Membership) -> None:
    """Make ``membership`` the job's epoch (or mark the job left if it excludes this
    member) and report the timed ``Reconfiguration``. Raises ``PeerLost`` if a member is
    lost meanwhile."""
    t0 = time.perf_counter()
    if job.comm is not None:
        job.comm.close()
        job.comm = None
    job.membership = membership
    if not membership.includes_me:
        job.left = True
        return
    job.planner.check(membership, job.done)  # refuses a batch it cannot split, early
    # After a false alarm the agents raise the epoch's timeouts: collectives, store reads.
    scale = membership.timeout_scale
    job.collective_timeout = timedelta(seconds=job.config.collective_timeout) * scale
    job.comm = Communicator.create(
        job.controller.store(membership.epoch),
        membership.epoch,
        membership.members,
        membership.me,
        job.collective_timeout,
        host=job.config.host,
        store_timeout=WATCH_TIMEOUT * scale,
        device=job.params[0].device,  # CUDA parameters: an NCCL epoch (comm/nccl.py)
    )
    t1, before = time.perf_counter(), job.done
    received = _agree_and_restore(job, job.comm)
    t2 = time.perf_counter()
    job.planner.enter(membership, job.done)
    if job.sharded is not None:  # its whole-tensor work follows the plan's weights too
        job.sharded.set_weights(job.planner.weights)
    # The caller's slots: which buffers changed, every member's compute seconds (and
    # micro-batch weights, for a weighted mean), the hyperparameters' hashes and the
    # planned-change flag (step.py).
    per_member = 2 if job.config.weighted_mean else 1
    count = job.buffer_sync.count + per_member * len(membership.members)
    count += job.hyper.count + 1
    job.reducer.set_caller_slots(count)
    t3 = time.perf_counter()
    record = Reconfiguration(
        epoch=membership.epoch,
        members=membership.members,
        communicator_s=t1 - t0,
        restore_s=t2 - t1,
        replan_s=t3 - t2,
        resume_step=job.done,
        rolled_back_steps=max(0, before - job.done) if not received else 0,
        received_state=received,
        **shard_figures(job.sharded),
    )
    job.reconfigurations.append(record)
    job.controller.on_reconfigured(record)


def _agree_and_restore(job: Job, comm: Communicator) -> bool:
    """Roll every member to the same committed step; return True if state came by wire."""
    job.snapshots.wait()
    fallback = job.membership.fallback if job.membership is not None else None
    if fallback is not None:  # a double fault lost sharded state: the checkpoint's step
        job.done, job.fresh = fall_back(job.snapshots, fallback), False
        job.loaded_step = None
    held, sharded = tuple(i.step for i in job.snapshots.infos()), job.sharded
    mine = MemberView(job.fresh, job.done, held, chunks=sharded.chunks if sharded else None)
    device = job.params[0].device
    kernels = model_kernels(job.model)  # compiled on some members only: refused
    timeout, mode = job.collective_timeout, job.config.mode
    views = exchange_views(comm, mine, timeout, mode, device, kernels)
    decision = resume_plan(views)
    log.info("epoch %d: %s", comm.epoch, decision.reason)
    resume = decision.resume_step
    limit = snapshot_limit(job.model)
    received = transfer_snapshot(comm, job.snapshots, decision, limit, job.collective_timeout)
    if job.loaded_step != resume or received or sharded is not None:
        extra = restore(job.snapshots.load(resume), job.model, job.optimizer, job.tracked)
        job.reducer.load_state_dict(sharded.from_snapshot(extra) if sharded else extra)
        job.lr_watch.reset()  # a restored lr is not a change the script made
        job.loaded_step = resume
    job.done = resume
    job.fresh = False
    if sharded is not None:  # its shards are cut from the full state just restored
        chunks = [v.chunks for v in views]
        try:
            sharded.enter(comm, comm.members, job.collective_timeout, chunks)
        except StateMissing as error:  # the next epoch must admit a worker that holds it
            raise PeerLost(comm.epoch, str(error), missing_state=True) from error
    return received and job.done > 0
