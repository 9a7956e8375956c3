"""The elastic job: the loop that survives membership changes in the same process.

`Job.steps(n)` yields `Step`s until n steps are committed. Between steps it asks the
controller for a planned change (drain, join); after a failed step it asks for the next
epoch. Entering an epoch is the data-plane half of a recovery (job_epoch.py):

    rebuild communicator -> exchange views and agree the resume step (rollback.py) ->
    restore (local snapshot, or a peer's snapshot over the network) -> replan

and each phase is timed into a `Reconfiguration` record handed back to the controller.
After each step the loop applies what `Step.commit` returned: it snapshots and reports a
committed step (its timings folded into the plan, which may ask to drain a member too slow:
balance.py), remembers whether a planned change was announced, and retries or recovers a
failed step. The snapshot is taken there, when the script's loop body has ended, so that
what the body advanced after `if step.commit():` (an LR scheduler, an EMA: the objects
tracked in tracked.py) is in the snapshot of the step it belongs to.

Between the reduction and the optimizer step (`apply_update`) run the script's
`before_optimizer_step` hooks and clipping by global norm: both see the same reduced
gradient on every member (ZeRO-2 gathers it for them), so they act identically at any
world size. A grad_scaler (float16 autocast) is driven by torch's own calls in the order
of its AMP recipe: `unscale_` before the hooks and clipping, `step`, `update`.
A step whose reduced gradient is non-finite is committed without an optimizer step
(`skip_update`), and the scale backs off, exactly as `scaler.step(); scaler.update()` do.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.utils.data import default_collate

from keepstep.elastic.balance import Planner
from keepstep.elastic.board import Board
from keepstep.elastic.buffers import BufferSync
from keepstep.elastic.comm import Communicator
from keepstep.elastic.config import JobConfig
from keepstep.elastic.control import Controller, Membership, Reconfiguration
from keepstep.elastic.data import MicroBatchLoader
from keepstep.elastic.dense import check_modules
from keepstep.elastic.errors import ConfigError, KeepstepError, PeerLost
from keepstep.elastic.evaluate import EvalFn, evaluate
from keepstep.elastic.heap import frozen_heap
from keepstep.elastic.hyper import HyperCheck
from keepstep.elastic.job_epoch import enter
from keepstep.elastic.loss_scale import SCALER_NAME, check_not_the_scaler, checked_scaler, skip_step
from keepstep.elastic.lr_watch import LrWatch
from keepstep.elastic.reduce import make_reducer
from keepstep.elastic.rng import STEP, SampleOrder, fix_determinism, rng_scope
from keepstep.elastic.sharded import optimizer_sha256, sharded_optimizer
from keepstep.elastic.snapshot_store import SnapshotStore
from keepstep.elastic.step import CommitResult, Step, StepOutcome
from keepstep.elastic.step_guard import StepGuard
from keepstep.elastic.tracked import Stateful, TrackedState
from keepstep.elastic.train_state import (
    capture,
    layout_signature,
    params_sha256,
    state_module,
)

log = logging.getLogger(__name__)

# How long a finished worker waits for its last epoch's abort listener to leave its store
# wait (woken through the store: ~1 ms when it answers).
_FINISH_WAIT_S = 2.0

Hook = Callable[[torch.nn.Module, torch.optim.Optimizer], object]
S = TypeVar("S", bound=Stateful)


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
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.grad_scaler = checked_scaler(grad_scaler)
        fix_determinism(config.threads)
        self.model = state_module(model)  # a compiled model's own module (train_state.py)
        self.optimizer = optimizer
        self.dataset = dataset
        self.config = config
        self.controller = controller
        self.snapshots = snapshots
        self.collate: Callable[[list[Any]], Any] = collate or default_collate
        self.loader = MicroBatchLoader(
            dataset,
            self.collate,
            config.prefetch,
            workers=config.loader_workers,
            seed=config.seed,
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require grad")
        # The reduction's layout is fixed here: a parameter unfrozen later is refused at
        # its first gradient (step.py), not trained on one member's gradient alone.
        self.frozen = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]
        check_modules(self.model)  # no sparse gradients (dense.py)
        self.reducer = make_reducer(config.mode, self.params, config.n_micro)
        self.order = SampleOrder(
            config.seed, len(dataset), config.micro_batch, config.n_micro, config.shuffle
        )
        if len(dataset) < config.global_batch:
            warnings.warn(
                f"the dataset holds {len(dataset)} samples, fewer than global_batch="
                f"{config.global_batch}: every step reads some of them twice (a step spans "
                "more than one pass over the data)",
                stacklevel=3,  # the script's keepstep.init
            )
        self.layout = layout_signature(self.model)
        self.buffer_sync = BufferSync(self.model, config.n_micro)  # BatchNorm's statistics
        self.collective_timeout = timedelta(seconds=config.collective_timeout)
        self.comm: Communicator | None = None
        self.membership: Membership | None = None
        self.planner = Planner(config)  # the plan, and its replans from speed (balance.py)
        self.left = False
        self.reconfigurations: list[Reconfiguration] = []
        self.tracked = TrackedState()
        self.board: Board | None = None  # TensorBoard scalars from the leader (board.py)
        if self.grad_scaler is not None:
            self.tracked.add(SCALER_NAME, self.grad_scaler)
        self.lr_watch = LrWatch(optimizer)
        self.hyper = HyperCheck(optimizer)  # members step with the same lr (hyper.py)
        self.step_guard = StepGuard(optimizer)  # the script's own optimizer.step() refused
        if self.grad_scaler is not None:  # and its scaler.step(), unscale_(), update()
            self.step_guard.guard_scaler(self.grad_scaler)
        # shard="zero1"/"zero2": the script's optimizer is stepped in shards (sharded.py).
        self.sharded = sharded_optimizer(config.shard, self.params, optimizer, self.reducer)
        self.hooks: list[Hook] = []
        infos = snapshots.infos()
        # A restarted worker resumes from its node's snapshots; a new one starts "fresh" (it
        # counts only if no member holds a committed state; it snapshots step 0 first).
        self.fresh = not infos
        self.done = infos[0].step if infos else 0
        self.loaded_step: int | None = None if infos else 0
        self.snapshot_s = 0.0

    # -- what the script adds -----------------------------------------------------------
    def track(self, name: str, obj: S) -> S:
        """Keep ``obj`` (anything with ``state_dict()`` / ``load_state_dict()``: an LR
        scheduler, an EMA model, the script's own counters) in every snapshot under
        ``name``; returns it. Register before `steps()`; advance it only for committed
        steps, after ``if step.commit():`` (see tracked.py)."""
        check_not_the_scaler(name, obj, self.grad_scaler)
        self.tracked.add(name, obj)
        return obj

    def before_optimizer_step(self, hook: Hook) -> Hook:
        """Call ``hook(model, optimizer)`` at every commit after the reduced gradient is in
        ``.grad`` (unscaled, with a grad_scaler) and before clipping and the optimizer step
        (inspect, adjust), but not for a skipped step; returns it, so it can decorate. It
        must act the same on every member: it sees the same gradient everywhere."""
        if not callable(hook):
            raise ConfigError(f"before_optimizer_step({hook!r}): not callable")
        self.hooks.append(hook)
        return hook

    def evaluate(
        self,
        dataset: Any,
        fn: EvalFn,
        *,
        names: Sequence[str],
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:
        """Total each of ``names`` over ``fn(batch)`` for every batch of ``dataset`` (the
        model in eval mode, no gradients), the batches split across members: the same
        totals on every member at any world size. Call it between steps, the same way on
        every member; ``fn`` returns additive quantities (a summed loss and a count). A
        member lost meanwhile costs no result (evaluate.py)."""
        return evaluate(self, dataset, fn, names, batch_size, collate_fn or self.collate)

    # -- the loop ---------------------------------------------------------------------
    def steps(self, total: int | None = None) -> Iterator[Step]:
        """Yield steps until `total` (default: the launcher's, `JobConfig.planned_steps`)
        are committed, or this member is drained."""
        planned = self.config.planned_steps
        if total is None:
            total = planned
            if total is None:
                raise ConfigError("job.steps() needs a step count (or a launcher that sets one)")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"steps={total!r} must be an int >= 0")
        if planned is not None and total > planned:
            # The launcher counts the job done at its step count: more would be refused at
            # the end, after all of it was trained.
            raise ConfigError(
                f"job.steps({total}) but the launcher set KEEPSTEP_STEPS={planned} "
                "(keepstep run --steps): call job.steps() to take the launcher's count, or "
                "make them agree"
            )
        with frozen_heap():  # the script's long-lived objects: out of the collector's way
            if self.membership is None:
                self.tracked.frozen = True
                if self.fresh:
                    self._snapshot()
                self._switch(self.controller.initial(self.config.collective_timeout))
            try:
                with self.step_guard.loop():
                    yield from self._loop(total)
            finally:
                self.loader.close()
        self.snapshots.wait()
        if self.left or (planned is not None and self.done < planned):
            return  # drained; or a segment of the launcher's run, which the next call goes on
        if planned is not None and self.comm is not None:
            # The worker's part is over (on_finish releases its store connections): its
            # last epoch's abort watch ends in order first. The group stays usable for
            # what the script gathers after the loop (optimizer_sha256 of a sharded job).
            self.comm.stop_watch(_FINISH_WAIT_S)
        self.controller.on_finish(self.done, self.params_sha256())

    def _loop(self, total: int) -> Iterator[Step]:
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
            # What the loop body draws outside its micro-batches is keyed by the step too:
            # the same on every member, and again when the step is repeated.
            with rng_scope(self.config.seed, step.index, 0, purpose=STEP):
                yield step
            result = step.result
            if result is None:
                raise ConfigError(f"step {step.index} ended without step.commit()")
            announced = result.announced
            retries = self._apply(step.index, result, retries)

    def _apply(self, index: int, result: CommitResult, retries: int) -> int:
        """Act on how step `index` ended; return the overflow retries in a row so far."""
        if result.outcome is StepOutcome.COMMITTED:
            assert result.record is not None
            t0, cpu0 = time.perf_counter(), time.process_time()
            self._snapshot()  # the loop body has ended: what it advanced for this step is in
            started, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            record, weights = result.record, self.planner.committed(index, result.compute_s)
            if weights and self.sharded is not None:  # a replan: the shard's work follows
                self.sharded.set_weights(weights)
            step_s, snapshot_s = record.step_s + started, record.snapshot_s + started
            record = replace(record, step_s=step_s, snapshot_s=snapshot_s, cpu_s=record.cpu_s + cpu)
            self.controller.on_commit(replace(record, new_weights=weights))
            self.planner.ask_drain(self.controller.request_drain)  # if too slow: slow_drain.py
            return 0
        # The step is repeated: the loop body must not have advanced tracked state in it.
        self.tracked.warn_if_moved(f"step {index} did not commit ({result.outcome.value})")
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

    def apply_update(self, index: int) -> float | None:
        """Hooks, clipping and the optimizer step on the reduced gradient (in .grad);
        returns the gradient's global norm before clipping when clipping is on. With a
        grad_scaler the gradient is unscaled first, so hooks and clipping see the
        true gradient. The step always steps: a reduction that succeeded summed finite
        gradients only, so `unscale_` finds no inf (a non-finite one goes to `skip_update`).
        """
        self._wait_for_snapshot()
        scaler, holder = self.grad_scaler, self.optimizer
        clip = self.config.clip_grad_norm
        windows = False  # ZeRO-2: its windows' gradient, clipped there (zero/clip.py)
        if self.sharded is not None:
            windows = clip is not None and not self.hooks and self.sharded.clips_windows()
            whole = bool(self.hooks) or (clip is not None and not windows)
            holder = self.sharded.grads_for_update(holder, whole)
        if scaler is not None:
            with self.step_guard.job_steps():
                scaler.unscale_(holder)
        for hook in self.hooks:
            hook(self.model, self.optimizer)
        norm = None
        if clip is not None and windows and self.sharded is not None:
            norm = self.sharded.clip(clip)  # the whole gradient's bits, from the windows
        elif clip is not None:
            # From the reduced gradient, which is the same on every member: so is the norm.
            # One fixed kernel path (foreach=False), whatever torch would pick by default.
            total = torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=False)
            norm = float(total)
        self.lr_watch.check(index, self.tracked.objects())
        with self.step_guard.job_steps():
            if self.sharded is not None:
                self.sharded.step()  # PeerLost in its all-gathers: the step does not commit
            elif scaler is not None:
                scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            if scaler is not None:  # sharded: unscale_ found no inf, all update needs
                scaler.update()
        self._advance()
        return norm

    def skip_update(self, index: int, reason: str) -> None:
        """Commit step `index` without an optimizer step: its reduced gradient has inf or
        nan, and the grad_scaler backs off, as torch's `scaler.step(); scaler.update()` do
        for such a step. Hooks and clipping do not run: there is no gradient to act on."""
        scaler = self.grad_scaler
        assert scaler is not None, "only a job with a grad_scaler skips steps"
        self._wait_for_snapshot()  # as in apply_update: nothing changes before the copy ends
        log.info("step %d skipped, the loss scale backs off: %s", index, reason)
        with self.step_guard.job_steps():  # finds the inf it plants: the optimizer never steps
            skip_step(scaler, self.optimizer)
        if self.sharded is not None:  # the unchanged state, gathered for the snapshot
            self.sharded.skip()
        self._advance()

    def _wait_for_snapshot(self) -> None:
        # The previous snapshot copy reads the live tensors: it must end before they change.
        # The wait is the snapshot's cost to this step (the copy overlaps the next step).
        t0 = time.perf_counter()
        self.snapshots.wait()
        self.snapshot_s = time.perf_counter() - t0

    def _advance(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.done += 1
        self.loaded_step = self.done

    def _snapshot(self) -> None:
        extra, optim = self.reducer.state_dict(), None
        if self.sharded is not None:  # its pieces of the state gathered at the commit
            extra, optim = self.sharded.for_snapshot(extra)
        state = capture(self.done, self.model, self.optimizer, extra, self.tracked, optim)
        # Buffers can change in the next forward while the copy runs, parameters (aliased in
        # the state dict, told apart by their memory) only in the next step, after wait().
        params = {p.data_ptr() for p in self.model.parameters()}
        tensors = {
            k: (v if not k.startswith("model/") or v.data_ptr() in params else v.detach().clone())
            for k, v in state.tensors.items()
        }
        self.snapshots.commit(self.done, tensors, state.meta)
        if self._read_for_checkpoint(self.done):
            # Bounded well inside a collective's timeout: the peers wait for this member
            # in the next step's reduction while it waits for its agent.
            self.snapshots.hold(self.done, self.config.collective_timeout / 4)

    def _read_for_checkpoint(self, step: int) -> bool:
        """Whether this member's agent reads `step` from its snapshot for a durable
        checkpoint: a due step of the epoch's first member (its snapshot is the whole
        checkpoint) or of any member of a sharded job (each snapshot is one part)."""
        every = self.config.checkpoint_every
        if every is None or step == 0 or step % every:  # step 0 is where a job starts
            return False
        return self.sharded is not None or self.is_leader

    @property
    def assignment(self) -> dict[str, list[int]]:
        """The plan of the step to come: micro-batch ids per member (balance.py)."""
        return self.planner.assignment

    @property
    def is_leader(self) -> bool:
        """True on the first member of the current epoch (for printing, once per job)."""
        m = self.membership
        return m is not None and m.includes_me and m.members[0] == m.me

    def params_sha256(self) -> str:
        """The bit-identity check every member reports at the end (train_state.params_sha256:
        the model's state dict, then the tracked state)."""
        tracked = self.tracked.sha256() if self.tracked.names else None
        return params_sha256(self.model.state_dict(), tracked)

    def optimizer_sha256(self) -> str:
        """sha256 over the full optimizer state (sharded: gathered, a collective)."""
        full = self.sharded.full_state() if self.sharded is not None else None
        return optimizer_sha256(full if full is not None else self.optimizer.state_dict())

    def state_sha256(self, name: str | None = None) -> str:
        """sha256 over one tracked object's state, or all of them (see tracked.py)."""
        return self.tracked.sha256(name)

    # -- entering an epoch --------------------------------------------------------------
    def _next_after(self, error: PeerLost) -> Membership:
        timeout = self.config.collective_timeout
        return self.controller.on_failure(error.epoch, self.done, error, timeout)

    def _switch(self, membership: Membership) -> None:
        """Enter `membership`; a peer lost while entering (a second fault during a
        recovery) moves on to the epoch after it, until one is entered."""
        while True:
            try:
                enter(self, membership)  # job_epoch.py
                return
            except PeerLost as error:
                log.warning("entering epoch %d failed: %s", membership.epoch, error)
                membership = self._next_after(error)
