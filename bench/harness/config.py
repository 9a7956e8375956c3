"""What one benchmark invocation runs: the workload, the machine layout and the run list.

bench/run.py builds a `BenchConfig` from its flags (the `--quick` or full preset, then any
size overrides); the runners read it; the job scripts get the `Workload` back as flags
(`Workload.flags()` there, `add_workload_args` + `workload_from` in the job). Nothing
here imports torch, so the harness process stays light while the jobs train.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, fields, replace
from typing import Any


class System(enum.Enum):
    """The systems compared, in the order their runs are interleaved."""

    DDP = "ddp"
    KEEPSTEP = "keepstep"
    TORCHRUN = "torchrun"
    TORCHFT = "torchft"


@dataclass(frozen=True)
class Workload:
    """The example transformer with dropout (examples/transformer.py) and its batch split."""

    d_model: int = 64
    layers: int = 2
    heads: int = 2
    seq: int = 32
    vocab: int = 128
    global_batch: int = 48
    micro_batch: int = 4
    steps: int = 36
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{f.name}={value!r} must be an int")
        for name in ("d_model", "layers", "heads", "seq", "vocab", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of heads={self.heads}")
        if self.global_batch < self.micro_batch or self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch={self.global_batch} must be a positive multiple of "
                f"micro_batch={self.micro_batch}"
            )

    @property
    def n_micro(self) -> int:
        """Micro-batches per step: global_batch = micro_batch x n_micro, for the whole job."""
        return self.global_batch // self.micro_batch

    def flags(self) -> list[str]:
        """This workload as command-line flags for a job script."""
        out: list[str] = []
        for f in fields(self):
            out += ["--" + f.name.replace("_", "-"), str(getattr(self, f.name))]
        return out


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The flags `Workload.flags()` writes, every one required (the harness passes all)."""
    for f in fields(Workload):
        parser.add_argument("--" + f.name.replace("_", "-"), type=int, required=True)


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})


@dataclass(frozen=True)
class BenchConfig:
    """One invocation: the workload, `nodes` single-process nodes, the runs to make."""

    workload: Workload
    nodes: int = 4
    min_nodes: int = 2
    schedule_seed: int = 0
    repeats: int = 1
    warmup_steps: int = 3
    systems: tuple[System, ...] = tuple(System)
    # The failure detector's timeout, the same for every system that has one: keepstep's
    # --hang-timeout and TorchFT's lighthouse heartbeat timeout.
    detect_timeout_s: float = 1.0
    run_timeout_s: float = 600.0
    # How TorchFT's replicas sum gradients: "manager" (its Manager's allreduce) or "ddp"
    # (its DistributedDataParallel wrapper, which crashes on a peer loss: see run_torchft).
    torchft_grad_sync: str = "manager"
    preset: str = "custom"

    def __post_init__(self) -> None:
        w = self.workload
        if not 2 <= self.min_nodes < self.nodes:
            raise ValueError(
                f"nodes={self.nodes}, min_nodes={self.min_nodes}: need 2 <= min_nodes < nodes "
                "so that losing a node leaves a working job"
            )
        # keepstep gives every worker (the nodes and the joiner) at least one micro-batch.
        if w.n_micro < self.nodes + 1:
            raise ValueError(
                f"global_batch {w.global_batch} / micro_batch {w.micro_batch} = {w.n_micro} "
                f"micro-batches; {self.nodes} nodes and one joiner need at least {self.nodes + 1}"
            )
        if w.steps < 4 * self.warmup_steps + 12:
            raise ValueError(
                f"steps={w.steps}: the fault schedule needs at least "
                f"{4 * self.warmup_steps + 12} (4 x warmup_steps + 12)"
            )
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} must be >= 1")
        if not self.systems or System.DDP not in self.systems:
            raise ValueError(
                f"systems={[s.value for s in self.systems]} must include ddp (the reference)"
            )
        if self.torchft_grad_sync not in ("manager", "ddp"):
            raise ValueError(
                f"torchft_grad_sync={self.torchft_grad_sync!r}: allowed are manager, ddp"
            )
        if self.detect_timeout_s < 1:
            raise ValueError(f"detect_timeout_s={self.detect_timeout_s} must be >= 1")

    def as_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "workload": {f.name: getattr(self.workload, f.name) for f in fields(Workload)},
            "n_micro": self.workload.n_micro,
            "nodes": self.nodes,
            "min_nodes": self.min_nodes,
            "schedule_seed": self.schedule_seed,
            "repeats": self.repeats,
            "warmup_steps": self.warmup_steps,
            "systems": [s.value for s in self.systems],
            "detect_timeout_s": self.detect_timeout_s,
            "torchft_grad_sync": self.torchft_grad_sync,
        }


def config_from_json(data: dict[str, Any]) -> BenchConfig:
    """The inverse of `BenchConfig.as_json` (for re-analysing a kept workdir)."""
    return BenchConfig(
        Workload(**data["workload"]),
        nodes=data["nodes"],
        min_nodes=data["min_nodes"],
        schedule_seed=data["schedule_seed"],
        repeats=data["repeats"],
        warmup_steps=data["warmup_steps"],
        systems=tuple(System(s) for s in data["systems"]),
        detect_timeout_s=data["detect_timeout_s"],
        torchft_grad_sync=data.get("torchft_grad_sync", "manager"),
        preset=data["preset"],
    )


# --quick: the small transformer, a short schedule, one round (a few minutes on two
# shared cores, most of it starting processes).
QUICK = BenchConfig(Workload(), preset="quick")
# The full run: a larger model, a schedule long enough for a new node to start and be
# admitted before the end (a node starting beside four training workers on two cores takes
# ~11-13 s to be admitted: at ~0.16 s a step the tail after the join needs ~80 steps), and
# three interleaved rounds, so that each median stands on three runs when one of them
# drifts (the same DDP job has taken 39 s in one round and 49.5 s in the next).
FULL = BenchConfig(
    Workload(d_model=128, layers=2, heads=2, seq=64, steps=192),
    repeats=3,
    preset="full",
)


def with_overrides(base: BenchConfig, **changes: Any) -> BenchConfig:
    """`base` with the non-None workload and bench fields of `changes` replaced."""
    names = {f.name for f in fields(Workload)}
    w_changes = {k: v for k, v in changes.items() if k in names and v is not None}
    b_changes = {k: v for k, v in changes.items() if k not in names and v is not None}
    unknown = set(b_changes) - {f.name for f in fields(BenchConfig)}
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}")
    return replace(base, workload=replace(base.workload, **w_changes), **b_changes)
