"""keepstep.elastic: the library inside each training process.

    job = keepstep.init(model, optimizer, dataset, global_batch=256, micro_batch=8, seed=0,
                        state={"sched": scheduler})  # kept in every snapshot
    for step in job.steps(1000):
        for mb in step.micro_batches():
            step.backward(loss_fn(model(mb.inputs), mb.targets))
        if step.commit():
            scheduler.step()  # advance tracked state for committed steps only

Micro-batch plan (plan.py) -> keyed RNG and sample order (rng.py) -> order-invariant
reduction (reduce.py) over a per-epoch communicator (comm/) -> snapshot of what a process
holds (train_state.py, with the script's tracked objects from tracked.py) into
double-buffered shared memory (snapshot_store.py). job.py ties them into the loop;
control.py is the boundary to the agent.

The names below are resolved on first use, so that a torch-free tool can import a torch-free
module of this package (snapshot_layout, errors) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from keepstep.elastic.api import init as init
    from keepstep.elastic.config import JobConfig as JobConfig
    from keepstep.elastic.control import CommitRecord as CommitRecord
    from keepstep.elastic.control import Controller as Controller
    from keepstep.elastic.control import Membership as Membership
    from keepstep.elastic.control import Reconfiguration as Reconfiguration
    from keepstep.elastic.control import ScheduleController as ScheduleController
    from keepstep.elastic.errors import ConfigError as ConfigError
    from keepstep.elastic.errors import KeepstepError as KeepstepError
    from keepstep.elastic.errors import PeerLost as PeerLost
    from keepstep.elastic.errors import ScriptStateWarning as ScriptStateWarning
    from keepstep.elastic.errors import SnapshotCorrupt as SnapshotCorrupt
    from keepstep.elastic.errors import SnapshotMissing as SnapshotMissing
    from keepstep.elastic.errors import StateShapeError as StateShapeError
    from keepstep.elastic.hyper import HyperparametersDiffer as HyperparametersDiffer
    from keepstep.elastic.job import Job as Job
    from keepstep.elastic.local_device import device as device
    from keepstep.elastic.optimizer_group import OptimizerGroup as OptimizerGroup
    from keepstep.elastic.reduce import ReduceMode as ReduceMode
    from keepstep.elastic.step import MicroBatch as MicroBatch
    from keepstep.elastic.step import NonFiniteGradient as NonFiniteGradient
    from keepstep.elastic.step import Step as Step
    from keepstep.elastic.tracked import Stateful as Stateful

_WHERE = {
    "init": "api",
    "JobConfig": "config",
    "CommitRecord": "control",
    "Controller": "control",
    "Membership": "control",
    "Reconfiguration": "control",
    "ScheduleController": "control",
    "device": "local_device",
    "OptimizerGroup": "optimizer_group",
    "ConfigError": "errors",
    "KeepstepError": "errors",
    "PeerLost": "errors",
    "SnapshotCorrupt": "errors",
    "SnapshotMissing": "errors",
    "StateShapeError": "errors",
    "ScriptStateWarning": "errors",
    "HyperparametersDiffer": "hyper",
    "Job": "job",
    "ReduceMode": "reduce",
    "MicroBatch": "step",
    "NonFiniteGradient": "step",
    "Step": "step",
    "Stateful": "tracked",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'keepstep.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"keepstep.elastic.{module}"), name)
    globals()[name] = value  # resolved once
    return value
