"""Job configuration: the numbers that stay fixed for the whole life of a job.

`JobConfig` is validated at construction; every later part (plan, reducer, sample order)
trusts it. The global batch is the invariant keepstep protects: it is
`micro_batch * n_micro` at every step, whatever the membership.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.plan import micro_batch_count
from keepstep.elastic.reduce import ReduceMode
from keepstep.elastic.slow_drain import DrainSlow


class Balance(enum.StrEnum):
    """How the micro-batches of a step are split over the members (balance.py)."""

    OFF = "off"  # evenly, or by the controller's `Membership.weights`
    SPEED = "speed"  # by measured speed: a slow member gets fewer, decided from step timings


class Shard(enum.StrEnum):
    """How the optimizer state is held across members (sharded.py); None: full replicas."""

    ZERO1 = "zero1"  # each member steps and keeps the optimizer state of its own shard
    ZERO2 = "zero2"  # and keeps only its shard of the reduced gradient (a reduce-scatter)


@dataclass(frozen=True)
class JobConfig:
    """What a training job promises: global batch, micro batch, seed and numerics.

    `threads` is the intra-op thread count every rank uses; it must be the same on all
    ranks and across runs for kernels to give the same bits. `collective_timeout` bounds
    every collective; a peer loss is normally detected far sooner (see comm/).
    `clip_grad_norm` clips the reduced gradient to that global L2 norm before the
    optimizer step; every member computes the norm from the same exact sum, so it clips
    identically at any world size.

    What the launcher decides for this process: `host` is the address peers reach it on
    (a pod's IP, a node's network-namespace address), which gloo binds and publishes;
    `planned_steps` is the step count `job.steps()` runs to when given none;
    `checkpoint_every` is the cadence of the node agents' durable checkpoints, which they
    read from this member's snapshots: a member whose snapshot they read keeps each due
    step in its slot until its agent has read it (None: no durable checkpoints).

    `metrics`: the names `step.log` takes, fixed for the job so every member reduces the
    same layout; `prefetch`: micro-batches read ahead of the training thread (data.py);
    `loader_workers`: processes that read them (data_workers.py; 0: threads).
    `balance`: whether the plan follows the members' measured speed (balance.py).
    `shard`: None keeps a full optimizer on every member; ``"zero1"`` shards its state and
    step (sharded.py), ``"zero2"`` the reduced gradient too (exact mode), with the same
    numbers. `drain_slow`: a member slower than
    ``below`` x the median speed for ``after`` steps in a row asks to be drained
    (slow_drain.py); None: never. `weighted_mean`: the reduced gradient is the sum of
    the micro-batches' gradients over the sum of the weights ``step.backward(loss,
    weight=)`` gives each (a token-weighted mean), not over the micro-batch count.
    """

    global_batch: int
    micro_batch: int
    seed: int = 0
    mode: ReduceMode = ReduceMode.EXACT
    threads: int = 1
    shuffle: bool = True
    collective_timeout: float = 30.0
    max_overflow_retries: int = 4
    host: str = "127.0.0.1"
    planned_steps: int | None = None
    checkpoint_every: int | None = None
    clip_grad_norm: float | None = None
    metrics: tuple[str, ...] = ()
    prefetch: int = 0
    loader_workers: int = 0
    balance: Balance = Balance.OFF
    shard: Shard | None = None
    drain_slow: DrainSlow | None = None
    weighted_mean: bool = False
    n_micro: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_micro", micro_batch_count(self.global_batch, self.micro_batch))
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer")
        try:
            mode = ReduceMode(self.mode)
        except ValueError:
            allowed = ", ".join(m.value for m in ReduceMode)
            raise ConfigError(f"mode={self.mode!r} is not one of: {allowed}") from None
        object.__setattr__(self, "mode", mode)
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"threads={self.threads!r} must be an integer >= 1")
        timeout = self.collective_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ConfigError(f"collective_timeout={timeout!r} must be a number of seconds > 0")
        if not isinstance(self.max_overflow_retries, int) or self.max_overflow_retries < 1:
            raise ConfigError(
                f"max_overflow_retries={self.max_overflow_retries!r} must be an integer >= 1"
            )
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"host={self.host!r} must be a non-empty address or hostname")
        steps = self.planned_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 0
        ):
            raise ConfigError(f"planned_steps={steps!r} must be an integer >= 0 (or None)")
        every = self.checkpoint_every
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, int) or every < 1
        ):
            raise ConfigError(f"checkpoint_every={every!r} must be an integer >= 1 (or None)")
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, int | float)
            or not (math.isfinite(clip) and clip > 0)
        ):
            raise ConfigError(f"clip_grad_norm={clip!r} must be a finite number > 0 (or None)")
        names = self.metrics
        if isinstance(names, str) or not all(
            isinstance(n, str) and n.isidentifier() for n in names
        ):
            raise ConfigError(
                f"metrics={names!r} must be a sequence of names step.log takes as keywords "
                "(e.g. ('loss', 'accuracy'))"
            )
        if len(set(names)) != len(names):
            raise ConfigError(f"metrics={names!r} names one metric twice")
        object.__setattr__(self, "metrics", tuple(names))
        if not isinstance(self.weighted_mean, bool):
            raise ConfigError(f"weighted_mean={self.weighted_mean!r} must be True or False")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int):
            raise ConfigError(f"prefetch={self.prefetch!r} must be an integer >= 0")
        if self.prefetch < 0:
            raise ConfigError(f"prefetch={self.prefetch!r} must be an integer >= 0")
        workers = self.loader_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"loader_workers={workers!r} must be an integer >= 0 (processes)")
        try:
            object.__setattr__(self, "balance", Balance(self.balance))
        except ValueError:
            allowed = ", ".join(b.value for b in Balance)
            raise ConfigError(f"balance={self.balance!r} is not one of: {allowed}") from None
        if self.shard is not None:
            try:
                object.__setattr__(self, "shard", Shard(self.shard))
            except ValueError:
                allowed = ", ".join(repr(s.value) for s in Shard)
                raise ConfigError(
                    f"shard={self.shard!r} is not one of: {allowed} (or None: full replicas)"
                ) from None
        if self.drain_slow is not None and not isinstance(self.drain_slow, DrainSlow):
            raise ConfigError(
                f"drain_slow={self.drain_slow!r} must be a DrainSlow (or None: never drain)"
            )
