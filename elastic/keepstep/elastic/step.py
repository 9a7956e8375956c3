"""One training step: the micro-batches this member computes, and the commit.

A `Step` is handed out by `Job.steps()`. The user runs forward and `step.backward(loss)`
for each micro-batch it yields, then `step.commit()`. A failure in the step (a lost peer,
a gradient overflow that needs a rescaled retry) is latched: `commit()` returns a false
`CommitResult` and the job repeats the step after the membership settles, instead of
raising through the user's loop. Nothing is applied to the model unless every member's
reduction succeeded. What the rest of the job must do about a step (report the commit,
act on an announced change, recover) is in the `CommitResult`, which `Job` applies.

A reduced gradient with inf or nan ends the job (`NonFiniteGradient`) unless the job
scales the loss (`keepstep.init(grad_scaler=...)`): then the step is committed but
skipped, as torch's AMP recipe skips it. The decision comes from the reduction's counts,
which are the same on every member, so every member skips the same steps.

What a member's compute seconds count (`CommitResult.compute_s`, what balance.py plans
from): the time the script's loop body runs per micro-batch, from the yield of the
micro-batch to the request for the next one: forward, backward, the local accumulation
of the gradient, `step.log`. Not counted: reading the micro-batch (or waiting for the
prefetcher), the collectives of the commit, and the snapshot taken after it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from keepstep.elastic.control import CommitRecord
from keepstep.elastic.dense import check_grads
from keepstep.elastic.errors import ConfigError, KeepstepError, PeerLost
from keepstep.elastic.metrics import StepMetrics
from keepstep.elastic.reduce import ReduceDone, ReduceNonFinite, ReduceOverflow
from keepstep.elastic.rng import DATA, rng_scope
from keepstep.elastic.train_state import check_layout
from keepstep.elastic.weights import check_exact_in, micro_batch_weight

if TYPE_CHECKING:
    from keepstep.elastic.job import Job


class StepOutcome(enum.Enum):
    """How a step ended. Only COMMITTED advances the job."""

    OPEN = "open"
    COMMITTED = "committed"
    RETRY = "retry"  # gradient overflow: recompute with the agreed larger scale
    FAILED = "failed"  # a peer was lost: wait for the next epoch, roll back, repeat


@dataclass(frozen=True)
class CommitResult:
    """How `Step.commit` ended, for the job to apply; true only when the step committed.

    ``announced``: some member flagged a planned change (drain, join) in this step's sum;
    ``record``: what a committed step reports; ``failure``: the lost peer of a failed one;
    ``grad_norm``: the reduced gradient's global norm before clipping, when the job clips;
    ``skipped``: the step committed without an optimizer step, because its reduced (loss
    scaled) gradient has inf or nan; the grad_scaler backed off (then ``grad_norm`` is None);
    ``metrics``: what ``step.log`` recorded, reduced (each name's mean over the step);
    ``compute_s``: every member's compute seconds in this step, as the sum carried them.
    """

    outcome: StepOutcome
    announced: bool = False
    record: CommitRecord | None = None
    failure: PeerLost | None = None
    grad_norm: float | None = None
    skipped: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict)
    compute_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        committed = self.outcome is StepOutcome.COMMITTED
        if committed != (self.record is not None):
            raise ConfigError(f"a {self.outcome.value} step has a record iff it committed")
        if self.skipped and not committed:
            raise ConfigError(f"a {self.outcome.value} step cannot be skipped: only a commit is")
        if (self.outcome is StepOutcome.FAILED) != (self.failure is not None):
            raise ConfigError(f"a {self.outcome.value} step has a failure iff it failed")

    def __bool__(self) -> bool:
        return self.outcome is StepOutcome.COMMITTED


class NonFiniteGradient(KeepstepError):
    """The global gradient of a step has inf or nan, and the job scales no loss: no
    rescaling of the reduction can fix it, and without a grad_scaler nothing skips it."""


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch: its id in the global batch, its sample indices and its data."""

    id: int
    indices: tuple[int, ...]
    data: Any

    @property
    def inputs(self) -> Any:
        """Item 0 of (inputs, targets) samples, collated: ``data[0]``."""
        return self._item(0, "inputs")

    @property
    def targets(self) -> Any:
        """Item 1 of (inputs, targets) samples, collated: ``data[1]``."""
        return self._item(1, "targets")

    def _item(self, i: int, name: str) -> Any:
        # Indexing other data would not fail, or fail obscurely: a batch of single tensors
        # would give its first sample as the inputs, a dict a KeyError of 0.
        data = self.data
        if isinstance(data, Mapping):
            keys = ", ".join(repr(k) for k in list(data)[:8])
            raise ConfigError(
                f"mb.{name}: this micro-batch's data is a mapping (keys {keys}), not "
                "(inputs, targets) pairs: read mb.data[key]"
            )
        if isinstance(data, torch.Tensor) or not isinstance(data, Sequence) or len(data) <= i:
            raise ConfigError(
                f"mb.{name}: the samples are not (inputs, targets) pairs (collated into "
                f"{_shape_of(data)}): read mb.data"
            )
        return data[i]


def _shape_of(data: object) -> str:
    if isinstance(data, torch.Tensor):
        return f"one tensor of shape {tuple(data.shape)}"
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return f"a sequence of {len(data)} items"
    return f"a {type(data).__name__}"


class Step:
    """One attempt at step `index` (the number of steps committed before it)."""

    def __init__(self, job: Job, index: int, micro_batch_ids: Sequence[int]) -> None:
        self.job = job
        self.index = index
        self.micro_batch_ids = tuple(micro_batch_ids)
        self.result: CommitResult | None = None  # set by commit()
        self._done_ids: list[int] = []
        self._indices: dict[int, list[int]] = {}  # per micro-batch, for the commit record
        self._current: int | None = None
        self._backward_done = False
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()
        self._compute_s = 0.0  # the loop body's seconds (see the module docstring)
        self._weight = 0  # the weights of this member's micro-batches (a weighted mean)
        names = job.config.metrics
        weighted = job.config.weighted_mean
        self._metrics = StepMetrics(names, job.config.n_micro, weighted) if names else None
        job.reducer.begin_step()
        job.buffer_sync.begin_step()

    def micro_batches(self) -> Iterator[MicroBatch]:
        """Yield this member's micro-batches, each inside its own keyed RNG scope."""
        job = self.job
        ids = self.micro_batch_ids
        planned = [((self.index, mb), job.order.indices(self.index, mb)) for mb in ids]
        ahead: list[tuple[tuple[int, int], list[int]]] = []
        if job.loader.prefetch:
            # The next step's micro-batches under the same plan: a guess the loader drops
            # if the plan changes (their samples depend on the step, never on the plan).
            ahead = [((self.index + 1, mb), job.order.indices(self.index + 1, mb)) for mb in ids]
        for i, mb_id in enumerate(ids):
            if job.comm is not None and job.comm.aborted(wait=False):
                # The epoch is already lost: stop computing, the commit will report it.
                return
            if job.loader.prefetch:
                job.loader.ahead(planned[i:] + ahead)
            indices = self._indices[mb_id] = planned[i][1]
            # A random augmentation in the dataset or collate_fn draws keyed numbers too.
            with rng_scope(job.config.seed, self.index, mb_id, purpose=DATA):
                data = job.loader.get((self.index, mb_id), indices)
            self._current, self._backward_done = mb_id, False
            with rng_scope(job.config.seed, self.index, mb_id):
                began = time.perf_counter()
                yield MicroBatch(mb_id, tuple(indices), data)
                self._compute_s += time.perf_counter() - began
            if not self._backward_done:
                raise ConfigError(
                    f"micro-batch {mb_id} of step {self.index} ended without step.backward(loss);"
                    " call it exactly once per micro-batch"
                )
            job.buffer_sync.end_micro_batch(mb_id)  # what it left in BatchNorm's stats
            self._done_ids.append(mb_id)
            self._current = None

    def backward(self, loss: torch.Tensor, weight: int | torch.Tensor | None = None) -> None:
        """Backpropagate one micro-batch's loss: its mean over the micro-batch, or, in a
        job with ``weighted_mean=True``, its sum over ``weight`` units (tokens that count).

        The gradient is folded into the step's order-invariant accumulator at once, so the
        parameters' `.grad` is free again for the next micro-batch.
        """
        if self._current is None:
            raise ConfigError("step.backward(loss) called outside `for mb in step.micro_batches()`")
        if self._backward_done:
            raise ConfigError(f"step.backward called twice for micro-batch {self._current}")
        mb_weight = micro_batch_weight(weight, self.job.config.weighted_mean)
        self._weight += mb_weight
        if self._metrics is not None and self._metrics.weighted:
            self._metrics.weights[self._current] = mb_weight
        loss.backward()  # type: ignore[no-untyped-call]
        for name, p in self.job.frozen:
            if p.grad is not None:
                raise ConfigError(
                    f"parameter {name!r} has a gradient, but it did not require grad when "
                    "keepstep.init ran: the job reduces only the parameters that did, so it "
                    "would train on this member's gradient alone. Make every parameter that "
                    "will train require grad before keepstep.init (hold one back with a "
                    "param group's lr of 0 until its time)"
                )
        params = self.job.params
        check_grads(self.job.model, params)
        self.job.reducer.add_micro_batch([p.grad for p in params])
        for p in params:
            p.grad = None
        self._backward_done = True

    def log(self, **values: object) -> None:
        """Log scalars of the current micro-batch (e.g. ``step.log(loss=loss)``), by the
        names declared in ``keepstep.init(metrics=...)``. At commit each is averaged over
        the step's micro-batches across members, the same value at any world size
        (``CommitResult.metrics``; also in the run's events and summary)."""
        if self._current is None:
            raise ConfigError("step.log(...) called outside `for mb in step.micro_batches()`")
        if self._metrics is None:
            names = ", ".join(values)
            raise ConfigError(
                f"step.log({names}=...): the job declares no metrics; pass "
                f"metrics=({', '.join(repr(n) for n in values)},) to keepstep.init"
            )
        self._metrics.log(self._current, values)

    @property
    def outcome(self) -> StepOutcome:
        return StepOutcome.OPEN if self.result is None else self.result.outcome

    @property
    def failure(self) -> PeerLost | None:
        return None if self.result is None else self.result.failure

    def commit(self) -> CommitResult:
        """Reduce across members, run the `before_optimizer_step` hooks, clip, and apply
        the optimizer (with a grad_scaler: unscale first; skip a non-finite step).

        The result is false unless the step committed; the job applies it (it is also kept
        as `step.result`) when the loop body ends: it snapshots the step then, so state the
        body advances after ``if step.commit():`` belongs to this step.
        """
        if self.result is not None:
            raise ConfigError(f"step {self.index} was already closed ({self.outcome.value})")
        self.result = self._commit()
        return self.result

    def _commit(self) -> CommitResult:
        job = self.job
        comm = job.comm
        assert comm is not None
        check_layout(job.layout, job.model)
        if len(self._done_ids) != len(self.micro_batch_ids):
            if not comm.aborted():
                raise ConfigError(
                    f"step {self.index}: commit after {len(self._done_ids)} of "
                    f"{len(self.micro_batch_ids)} micro-batches; iterate step.micro_batches() fully"
                )
            return self._fail(PeerLost(comm.epoch, "epoch aborted during compute"))
        timeout = job.collective_timeout
        buffer = job.reducer.buffer()
        # The caller's slots (Job sets B + world size + 2G + 1): [which of the B model
        # buffers this member's micro-batches changed (buffers.py) | compute seconds of rank
        # 0 .. W-1 | the hashes of the G param groups' hyperparameters (hyper.py) |
        # planned-change flag]. A member writes its own seconds; `begin_step` zeroed the
        # others', so the sum hands every member each figure exactly (x + 0 = x in a float
        # format), and all members learn of a planned change in the same step, with no
        # collective more.
        assert buffer.is_floating_point(), "the caller's slots carry seconds"
        n_buf, size, weighted = job.buffer_sync.count, comm.size, job.config.weighted_mean
        n_hyper = job.hyper.count
        slots = buffer[-(n_buf + (2 if weighted else 1) * size + n_hyper + 1) :]
        if n_buf:
            flags = job.buffer_sync.flags()
            slots[:n_buf] = torch.tensor(flags, dtype=slots.dtype, device=slots.device)
        slots[n_buf + comm.rank] = self._compute_s
        if weighted:  # [... | weights of rank 0 .. W-1 |]: each exact in the buffer's format
            slots[n_buf + size + comm.rank] = check_exact_in(self._weight, slots.dtype)
        job.hyper.fill(slots[-1 - n_hyper : -1], size)
        slots[-1] = 1 if job.controller.change_pending() else 0
        sharded = job.sharded if job.sharded is not None and job.sharded.scatters else None
        try:
            if sharded is not None:  # ZeRO-2: each member receives the sum of its shard
                sharded.reduce(comm, buffer, timeout)
            else:
                comm.allreduce(buffer, dist.ReduceOp.SUM, timeout)
        except PeerLost as error:
            return self._fail(error)
        *summed_slots, flag = buffer[-len(slots) :].tolist()
        cut = len(summed_slots) - n_hyper
        summed_slots, hyper = summed_slots[:cut], summed_slots[cut:]
        job.hyper.check(hyper, size, self.index)  # every member decides from the same sums
        changed = [count > 0 for count in summed_slots[:n_buf]]  # members that changed each
        announced = bool(flag)
        compute_s = dict(zip(comm.members, summed_slots[n_buf : n_buf + size], strict=True))
        # Summed as Python ints, exactly, in rank order: the same total on every member.
        total = sum(int(w) for w in summed_slots[n_buf + size :]) if weighted else None
        if total == 0:
            raise ConfigError(
                f"step {self.index}: the weights of all its micro-batches sum to 0, so "
                "there is no mean to take (every token of the global batch masked out?)"
            )
        metrics: dict[str, float] = {}
        # Both before `finish`, which writes the gradient and moves the reducer's exponents:
        # a member that lost a peer here must still be where a member that lost it in the
        # gradient's sum is, or the step repeated after the rollback differs.
        if self._metrics is not None:
            summed = self._metrics.buffer(comm.device)
            try:
                comm.allreduce(summed, dist.ReduceOp.SUM, timeout)
            except PeerLost as error:
                return self._fail(error)
            metrics = self._metrics.reduce(summed, self.index)
        buffers: torch.Tensor | None = None
        if any(changed):  # every member knows: the flags came in the gradient's sum
            buffers = job.buffer_sync.gather(changed, comm.device)
            try:
                comm.allreduce(buffers, dist.ReduceOp.SUM, timeout)
            except PeerLost as error:
                return self._fail(error)
        if sharded is not None:
            outcome = sharded.finish(buffer, job.config.n_micro, job.params, total)
        else:
            outcome = job.reducer.finish(buffer, job.config.n_micro, job.params, total)
        if isinstance(outcome, ReduceOverflow):
            peak = job.reducer.retry_max_buffer()
            try:
                comm.allreduce(peak, dist.ReduceOp.MAX, timeout)
            except PeerLost as error:
                return self._fail(error)
            job.reducer.set_retry_exponents(peak)
            return CommitResult(StepOutcome.RETRY)
        # The state changes here, not when the job applies the result: the user's code
        # after commit() sees the new parameters.
        if isinstance(outcome, ReduceNonFinite):
            if job.grad_scaler is None:
                raise NonFiniteGradient(f"step {self.index}: {outcome.reason}")
            # The scaled loss overflowed somewhere in the global batch. Every member reads
            # the same summed counts, so every member skips this step.
            job.skip_update(self.index, outcome.reason)
            norm, skipped = None, True
        else:
            assert isinstance(outcome, ReduceDone)
            try:
                # A sharded optimizer (shard="zero1") all-gathers in its step: a peer lost
                # there fails the step, and the job restores its snapshot (sharded.py).
                norm, skipped = job.apply_update(self.index), False
            except PeerLost as error:
                for p in job.params:  # the reduced gradient must not add to the next backward
                    p.grad = None
                return self._fail(error)
        if buffers is not None:  # committed (an update skipped too: the forwards ran)
            job.buffer_sync.apply(buffers, changed)
        record = CommitRecord(
            step=self.index,
            epoch=comm.epoch,
            world_size=comm.size,
            micro_batches=self.micro_batch_ids,
            samples=tuple(i for mb in self.micro_batch_ids for i in self._indices[mb]),
            step_s=time.perf_counter() - self._started,
            assignment=job.assignment,
            snapshot_s=job.snapshot_s,
            skipped=skipped,
            metrics=metrics,
            compute_s=compute_s[comm.me],
            cpu_s=time.process_time() - self._cpu_started,
        )
        if job.board is not None and metrics and job.is_leader:
            job.board.write(self.index, metrics)
        return CommitResult(
            StepOutcome.COMMITTED,
            announced=announced,
            record=record,
            grad_norm=norm,
            skipped=skipped,
            metrics=metrics,
            compute_s=compute_s,
        )

    def _fail(self, error: PeerLost) -> CommitResult:
        self.job.reducer.abandon_buffer()
        return CommitResult(StepOutcome.FAILED, failure=error)
