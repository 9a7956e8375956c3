"""The spec of a TrainJob, parsed and validated: what the user asked for.

Where it sits: `model.Job.from_object` parses `spec` with `JobSpec.from_dict`; `podspec`
turns it into agent flags and a pod. Defaults match the CRD's (manifests/crd/trainjob.yaml),
so an object that skipped the API server's defaulting still parses; anything that can never
work, or would run differently from what it says, raises `SpecError` naming the field and
the rule (field checks: `fields`; the pod template: `template`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keepstep.operator.errors import SpecError
from keepstep.operator.fields import (
    GPU,
    check_checkpoint_uri,
    check_env,
    check_resources,
    gpus_per_node,
)
from keepstep.operator.template import PodTemplate


def _int(spec: Mapping[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = spec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{name}={value!r} must be an integer")
    return value


def _strings(spec: Mapping[str, Any], name: str, where: str) -> tuple[str, ...]:
    value = spec.get(name) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SpecError(f"{where}.{name}={value!r} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True)
class FailurePolicy:
    """spec.failurePolicy; None: the operator's setting (`settings.DecideConfig`)."""

    pending_timeout_s: int | None = None
    backoff_limit: int | None = None
    window_s: int | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> FailurePolicy:
        where = "spec.failurePolicy"
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise SpecError(f"{where}={raw!r} must be an object")
        values: dict[str, int | None] = {}
        for key, attr, low in (
            ("pendingTimeoutSeconds", "pending_timeout_s", 1),
            ("backoffLimit", "backoff_limit", 0),
            ("windowSeconds", "window_s", 1),
        ):
            if key not in raw:
                continue
            value = _int(raw, key, where)
            if value < low:
                raise SpecError(f"{where}.{key}={value} must be >= {low}")
            values[attr] = value
        unknown = sorted(set(raw) - {"pendingTimeoutSeconds", "backoffLimit", "windowSeconds"})
        if unknown:
            raise SpecError(f"{where}: unknown fields {unknown}")
        return cls(**values)


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
    template: PodTemplate = field(default_factory=PodTemplate)
    failure: FailurePolicy = field(default_factory=FailurePolicy)

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
        if self.seed < 0:
            raise SpecError(f"spec.trainer.seed={self.seed} must be >= 0")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise SpecError(
                f"spec.elasticPolicy.minNodes={self.min_nodes}, maxNodes={self.max_nodes}: "
                "need 1 <= minNodes <= maxNodes"
            )
        for name, value in (
            ("globalBatchSize", self.global_batch),
            ("microBatchSize", self.micro_batch),
        ):
            if value < 1:
                raise SpecError(f"spec.elasticPolicy.{name}={value} must be >= 1")
        if self.global_batch % self.micro_batch:
            raise SpecError(
                f"spec.elasticPolicy.globalBatchSize={self.global_batch} must be a multiple of "
                f"microBatchSize={self.micro_batch} (>= 1)"
            )
        if self.global_batch // self.micro_batch < self.max_nodes * self.nproc_per_node:
            raise SpecError(
                f"spec.elasticPolicy.globalBatchSize={self.global_batch} / microBatchSize="
                f"{self.micro_batch} = {self.global_batch // self.micro_batch} micro-batches "
                f"per step cannot feed maxNodes={self.max_nodes} x numProcPerNode="
                f"{self.nproc_per_node} workers"
            )
        check_env(self.env)
        gpus = gpus_per_node(self.resources)
        if gpus and gpus != self.nproc_per_node:
            raise SpecError(
                f"spec.trainer.numProcPerNode={self.nproc_per_node} but "
                f"spec.trainer.resourcesPerNode asks for {gpus} {GPU} per node: keepstep runs "
                f"one worker per GPU (worker LOCAL_RANK on GPU LOCAL_RANK), so they must be equal"
            )

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
        image = trainer.get("image") or ""
        if not isinstance(image, str):
            raise SpecError(f"spec.trainer.image={image!r} must be a string")
        env = trainer.get("env") or []
        if not isinstance(env, list):
            raise SpecError(f"spec.trainer.env={env!r} must be a list of name/value objects")
        ckpt = spec.get("checkpoint")
        checkpoint = None
        if ckpt is not None:
            if not isinstance(ckpt, Mapping) or not isinstance(ckpt.get("uri"), str):
                raise SpecError(f"spec.checkpoint={ckpt!r} must be an object with a uri")
            checkpoint = Checkpoint(
                check_checkpoint_uri(ckpt["uri"]), _int(ckpt, "everySteps", "spec.checkpoint", 0)
            )
        suspend = spec.get("suspend", False)
        if not isinstance(suspend, bool):
            raise SpecError(f"spec.suspend={suspend!r} must be true or false")
        return cls(
            image=image,
            command=_strings(trainer, "command", "spec.trainer"),
            args=_strings(trainer, "args", "spec.trainer"),
            env=tuple(env),
            num_nodes=_int(trainer, "numNodes", "spec.trainer"),
            nproc_per_node=_int(trainer, "numProcPerNode", "spec.trainer", 1),
            resources=check_resources(trainer.get("resourcesPerNode")),
            num_steps=_int(trainer, "numSteps", "spec.trainer"),
            seed=_int(trainer, "seed", "spec.trainer", 0),
            min_nodes=_int(policy, "minNodes", "spec.elasticPolicy", 1),
            max_nodes=_int(policy, "maxNodes", "spec.elasticPolicy"),
            global_batch=_int(policy, "globalBatchSize", "spec.elasticPolicy"),
            micro_batch=_int(policy, "microBatchSize", "spec.elasticPolicy"),
            checkpoint=checkpoint,
            suspend=suspend,
            template=PodTemplate.from_dict(spec.get("podTemplate")),
            failure=FailurePolicy.from_dict(spec.get("failurePolicy")),
        )
