"""keepstep.elastic: the library inside each training process.

    job = keepstep.init(model, optimizer, dataset, global_batch=256, micro_batch=8, seed=0)
    for step in job.steps(1000):
        for mb in step.micro_batches():
            step.backward(loss_fn(model(mb.inputs), mb.targets))
        step.commit()

Micro-batch plan (plan.py) -> keyed RNG and sample order (rng.py) -> order-invariant
reduction (reduce.py) over a per-epoch communicator (comm.py) -> snapshot (snapshot.py,
state.py). job.py ties them into the loop; control.py is the boundary to the agent.
"""

from keepstep.elastic.api import init
from keepstep.elastic.config import JobConfig
from keepstep.elastic.control import (
    CommitRecord,
    Controller,
    Membership,
    Reconfiguration,
    ScheduleController,
)
from keepstep.elastic.errors import (
    ConfigError,
    KeepstepError,
    PeerLost,
    SnapshotCorrupt,
    SnapshotMissing,
    StateShapeError,
)
from keepstep.elastic.job import Job
from keepstep.elastic.reduce import ReduceMode
from keepstep.elastic.step import MicroBatch, NonFiniteGradient, Step

__all__ = [
    "CommitRecord",
    "ConfigError",
    "Controller",
    "Job",
    "JobConfig",
    "KeepstepError",
    "Membership",
    "MicroBatch",
    "NonFiniteGradient",
    "PeerLost",
    "Reconfiguration",
    "ReduceMode",
    "ScheduleController",
    "SnapshotCorrupt",
    "SnapshotMissing",
    "StateShapeError",
    "Step",
    "init",
]
