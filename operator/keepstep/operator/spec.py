"""The spec of a TrainJob, parsed and validated: what the user asked for.

Where it sits: `model.Job.from_object` parses `spec` with `JobSpec.from_dict`; `podspec`
turns it into agent flags. Defaults match the CRD's (manifests/crd/trainjob.yaml), so an
object that skipped the API server's defaulting still parses; anything that can never work
raises `SpecError` naming the field and the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keepstep.operator.errors import SpecError


def _int(spec: Mapping[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = spec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{name}={value!r} must be an integer")
    return value


@dataclass(frozen=True)
class Checkpoint:
    uri: str
    every_steps: int = 0

    def __post_init__(self) -> None:
        if not self.uri:
            raise SpecError("spec.checkpoint.uri='' must name a storage URL (file://, s3://)")
        if self.every_steps < 0:
            raise SpecError(f"spec.checkpoint.everySteps={self.every_steps} must be >= 0")


@dataclass(frozen=True)
class JobSpec:
    """spec of a TrainJob (trainer + elasticPolicy + checkpoint), defaults applied."""

    image: str
    command: tuple[str, ...]
    num_nodes: int
    num_steps: int
    max_nodes: int
    global_batch: int
    micro_batch: int
    min_nodes: int = 1
    nproc_per_node: int = 1
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    checkpoint: Checkpoint | None = None
    suspend: bool = False

    def __post_init__(self) -> None:
        if not self.image:
            raise SpecError("spec.trainer.image='' must name a container image")
        if not self.command:
            raise SpecError("spec.trainer.command=[] must hold at least the program to run")
        if self.num_nodes < 1:
            raise SpecError(f"spec.trainer.numNodes={self.num_nodes} must be >= 1")
        if not 1 <= self.nproc_per_node <= 64:
            raise SpecError(f"spec.trainer.numProcPerNode={self.nproc_per_node} must be 1..64")
        if self.num_steps < 1:
            raise SpecError(f"spec.trainer.numSteps={self.num_steps} must be >= 1")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise SpecError(
                f"spec.elasticPolicy minNodes={self.min_nodes}, maxNodes={self.max_nodes}: "
                "need 1 <= minNodes <= maxNodes"
            )
        if self.micro_batch < 1 or self.global_batch % self.micro_batch:
            raise SpecError(
                f"spec.elasticPolicy globalBatchSize={self.global_batch} must be a multiple of "
                f"microBatchSize={self.micro_batch} (>= 1)"
            )
        if self.global_batch // self.micro_batch < self.max_nodes * self.nproc_per_node:
            raise SpecError(
                f"spec.elasticPolicy: {self.global_batch // self.micro_batch} micro-batches "
                f"per step cannot feed maxNodes={self.max_nodes} x numProcPerNode="
                f"{self.nproc_per_node} workers"
            )
        for entry in self.env:
            if not isinstance(entry, Mapping) or not entry.get("name"):
                raise SpecError(f"spec.trainer.env entry {entry!r} needs a name")

    @property
    def desired_nodes(self) -> int:
        """How many pods to run: numNodes (what /scale sets), never above maxNodes."""
        return min(self.num_nodes, self.max_nodes)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> JobSpec:
        trainer = spec.get("trainer")
        policy = spec.get("elasticPolicy")
        if not isinstance(trainer, Mapping) or not isinstance(policy, Mapping):
            raise SpecError("spec.trainer and spec.elasticPolicy are required objects")
        command, args = trainer.get("command") or [], trainer.get("args") or []
        if not all(isinstance(c, str) for c in [*command, *args]):
            raise SpecError("spec.trainer.command and args must be lists of strings")
        ckpt = spec.get("checkpoint")
        checkpoint = None
        if isinstance(ckpt, Mapping) and ckpt.get("uri"):
            checkpoint = Checkpoint(
                str(ckpt["uri"]), _int(ckpt, "everySteps", "spec.checkpoint", 0)
            )
        resources = trainer.get("resourcesPerNode") or {}
        return cls(
            image=str(trainer.get("image") or ""),
            command=tuple(command),
            args=tuple(args),
            env=tuple(trainer.get("env") or ()),
            num_nodes=_int(trainer, "numNodes", "spec.trainer"),
            nproc_per_node=_int(trainer, "numProcPerNode", "spec.trainer", 1),
            resources=dict(resources) if isinstance(resources, Mapping) else {},
            num_steps=_int(trainer, "numSteps", "spec.trainer"),
            seed=_int(trainer, "seed", "spec.trainer", 0),
            min_nodes=_int(policy, "minNodes", "spec.elasticPolicy", 1),
            max_nodes=_int(policy, "maxNodes", "spec.elasticPolicy"),
            global_batch=_int(policy, "globalBatchSize", "spec.elasticPolicy"),
            micro_batch=_int(policy, "microBatchSize", "spec.elasticPolicy"),
            checkpoint=checkpoint,
            suspend=bool(spec.get("suspend", False)),
        )
