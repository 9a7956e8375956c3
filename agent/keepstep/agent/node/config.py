"""The node agent's configuration: what `keepstep run` (or a pod's entrypoint) hands it.

It travels as a JSON file, so that a node's whole setup is visible in its run directory.
The environment of a worker is built here too, and only here: the job's settings
(`worker_env`, which `keepstep run` and `keepstep agent` both use) and what the agent
adds per worker (`worker_spec`), among it how long the worker waits for each of the
agent's answers (`answer_bounds`, derived from the agent's own bounds).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keepstep.agent.node.supervisor import WorkerSpec
from keepstep.agent.protocol.link import AnswerBounds
from keepstep.errors import ConfigError


@dataclass(frozen=True)
class AgentConfig:
    job: str
    node: str
    etcd: str
    script: str
    # The job's etcd credentials (ca.crt, tls.crt, tls.key); None: plain gRPC (a test's etcd).
    etcd_tls: Path | None = None
    script_args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()  # a worker's whole command line (else python SCRIPT ARGS)
    nproc: int = 1
    run_dir: Path = Path(".")
    worker_env: dict[str, str] = field(default_factory=dict)
    expected_nodes: int = 1
    min_nodes: int = 1
    lease_ttl: float = 1.0
    probe_timeout: float = 0.3
    # A ring neighbour silent this long is lost (heartbeat.py); 0: only the lease finds hangs.
    heartbeat_timeout: float = 0.5
    heartbeat_interval: float = 0.1
    # Epoch 0 starts without the missing nodes (if min_nodes are there) after this long.
    admission_grace: float = 30.0
    # A worker waits at most this long to be admitted (epoch 0, a join, or back after an
    # exclusion). Generous: pods may take minutes to be scheduled and pull their image, and
    # a joiner waits for the next step boundary. Past it the worker gets AdmissionTimeout.
    admission_timeout: float = 3600.0
    # An epoch agreed (by this agent or another) reaches this agent's view within this.
    epoch_timeout: float = 30.0
    # An epoch whose members lack sharded state (its holder's worker is restarting, or a
    # double fault lost it) waits this long for a worker from outside it to admit; past
    # it the job stops, to be resumed from its durable checkpoint.
    missing_state_wait: float = 120.0
    op_timeout: float = 5.0
    max_restarts: int = 3
    snapshot_dir: Path = Path("/dev/shm")
    host: str = "127.0.0.1"  # the address peers reach this node's probe and store on
    store_port: int = 0  # the process-group store this node hosts (0: any free port)
    steps: int = 0
    checkpoint_url: str | None = None
    checkpoint_every: int = 0
    storage_options: dict[str, Any] = field(default_factory=dict)
    resume_blob: Path | None = None  # a durable checkpoint to start every worker from
    resume_step: int = 0
    warm_spare: bool = False  # keep a process with torch imported to replace a crashed worker
    # Where a failed agent writes why (a pod's /dev/termination-log: the kubelet puts it in
    # the container's status, where `kubectl describe pod` and the operator read it).
    termination_log: Path | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"nproc={self.nproc} must be >= 1")
        if not 1 <= self.min_nodes <= max(self.expected_nodes, 1):
            raise ConfigError(
                f"min_nodes={self.min_nodes} must be between 1 and expected_nodes="
                f"{self.expected_nodes}"
            )
        if self.lease_ttl < 1:
            raise ConfigError(f"lease_ttl={self.lease_ttl} must be >= 1 s (etcd leases)")
        for name in (
            "probe_timeout",
            "admission_timeout",
            "epoch_timeout",
            "missing_state_wait",
            "op_timeout",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value!r} must be a number of seconds > 0")
        for name in ("heartbeat_timeout", "heartbeat_interval"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0")
        if self.heartbeat_interval == 0 and self.heartbeat_timeout > 0:
            raise ConfigError("heartbeat_interval=0: heartbeats need an interval > 0 s")
        if not self.admission_grace >= 0:
            raise ConfigError(f"admission_grace={self.admission_grace!r} must be >= 0 s")

    @property
    def global_batch(self) -> int:
        """The job's global batch, as its workers are told it (0 when not set)."""
        return int(self.worker_env.get(GLOBAL_BATCH_ENV, "0"))


GLOBAL_BATCH_ENV = "KEEPSTEP_GLOBAL_BATCH"
# What deterministic cuBLAS needs (keepstep.elastic.rng.CUBLAS_WORKSPACE_CONFIG; not
# imported from there, which would import torch into the agent).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

# What a worker adds to the agent's own bounds before it takes a silent agent for wedged:
# the link's round trip and the agent's threads running late on a loaded machine.
ANSWER_SLACK_S = 10.0


def worker_env(
    *,
    global_batch: int,
    micro_batch: int,
    steps: int,
    seed: int,
    mode: str,
    host: str,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The job's settings as every worker reads them (`keepstep.init` checks its own
    arguments against them): `AgentConfig.worker_env`. `host` is the node's address,
    which the workers' gloo binds and publishes, as the agent does; `extra` comes last."""
    env = {
        GLOBAL_BATCH_ENV: str(global_batch),
        "KEEPSTEP_MICRO_BATCH": str(micro_batch),
        "KEEPSTEP_STEPS": str(steps),
        "KEEPSTEP_SEED": str(seed),
        "KEEPSTEP_MODE": mode,
        "KEEPSTEP_HOST": host,
    }
    env.update(extra or {})
    return env


# A boundary's decision (or an admission's record) is asked again while etcd does not
# answer (it elects a new leader), for at most this many op timeouts (healer.py).
BOUNDARY_RETRY_OPS = 2
# An agent cut off from most of a failed epoch's nodes waits this many leases for their
# leases to expire (then it decides) or their epoch; still cut off, it leaves the decision
# to them (healer.py).
MINORITY_WAIT_LEASES = 3


def answer_bounds(cfg: AgentConfig) -> AnswerBounds:
    """How long this agent's workers wait for its answers: the agent's own bounds on the
    same work, plus slack, so that the agent's answer (a typed error included) comes first
    and only a wedged agent meets a worker's bound."""
    # hello and finish: a few etcd writes at most (the progress, the done record).
    reply = 4 * cfg.op_timeout + ANSWER_SLACK_S
    # boundary and failure: the decisions of this node's other members ahead of it under
    # the agree lock (probes and a compare-and-set each), its own, the epoch appearing.
    decision = (
        cfg.epoch_timeout
        + (cfg.nproc + 1) * (cfg.probe_timeout + 2 * cfg.op_timeout)
        + BOUNDARY_RETRY_OPS * cfg.op_timeout
        + MINORITY_WAIT_LEASES * cfg.lease_ttl
        + ANSWER_SLACK_S
    )
    # initial: writing and removing the pending key around the wait itself, each asked
    # again while etcd elects a leader.
    admission = (
        cfg.admission_timeout + (3 + 2 * BOUNDARY_RETRY_OPS) * cfg.op_timeout + ANSWER_SLACK_S
    )
    return AnswerBounds(reply=reply, decision=decision, admission=admission)


def checkpoint_cadence(cfg: AgentConfig) -> int | None:
    """Every how many steps this node's durable checkpoints are due (and at the last step),
    or None when the job writes none."""
    if not cfg.checkpoint_url:
        return None
    return cfg.checkpoint_every or max(cfg.steps, 1)


def snapshot_path(cfg: AgentConfig, member: str) -> Path:
    """The worker's snapshot file: node-local shared memory that outlives the worker."""
    return cfg.snapshot_dir / f"keepstep-{cfg.job}-{member.replace('/', '-')}"


def fatal_path(cfg: AgentConfig, member: str) -> Path:
    """Where the worker records an error no restart mends (keepstep/fatal.py)."""
    return cfg.run_dir / f"fatal-{cfg.node}-{member.rpartition('/')[2]}.json"


def worker_spec(
    cfg: AgentConfig, member: str, link: str, snapshot: Path, resume: Path | None = None
) -> WorkerSpec:
    """How to start one training process: the script, and the job's settings in its env
    (``resume``: the checkpoint it starts from while its snapshot file holds none)."""
    env = dict(os.environ)
    env.update(cfg.worker_env)
    env.update(
        KEEPSTEP_CONTROLLER="keepstep.agent.worker.controller:controller_from_env",
        KEEPSTEP_FATAL=str(fatal_path(cfg, member)),
        KEEPSTEP_LINK=link,
        KEEPSTEP_MEMBER=member,
        KEEPSTEP_SNAPSHOT=str(snapshot),
        OMP_NUM_THREADS="1",
    )
    env.pop("KEEPSTEP_RESUME", None)
    if resume is not None:
        env["KEEPSTEP_RESUME"] = str(resume)
    # The worker keeps each due step in its snapshot until this agent has read it.
    env.pop("KEEPSTEP_CHECKPOINT_EVERY", None)
    if (every := checkpoint_cadence(cfg)) is not None:
        env["KEEPSTEP_CHECKPOINT_EVERY"] = str(every)
    env.update(answer_bounds(cfg).env())
    # torchrun's names: the worker's slot on this node (keepstep.device() picks GPU
    # LOCAL_RANK) and how many slots the node has. Ranks are the epoch's, never set here.
    env.update(LOCAL_RANK=member.rpartition("/")[2], LOCAL_WORLD_SIZE=str(cfg.nproc))
    # cuBLAS reads it once, when CUDA starts: set before the script can touch a GPU (the
    # value keepstep.elastic.rng.fix_determinism needs; one the user set wins).
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    local = member.rpartition("/")[2]
    return WorkerSpec(
        member,
        list(cfg.command) or [sys.executable, cfg.script, *cfg.script_args],
        env,
        cfg.run_dir / f"worker-{cfg.node}-{local}.log",
    )


def dump_config(cfg: AgentConfig, path: Path) -> None:
    data = asdict(cfg)
    path.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in data.items()}))


def load_config(path: Path) -> AgentConfig:
    raw: dict[str, Any] = json.loads(path.read_text())
    for name in ("run_dir", "snapshot_dir", "resume_blob", "termination_log", "etcd_tls"):
        if raw.get(name) is not None:
            raw[name] = Path(raw[name])
    raw["script_args"] = tuple(raw.get("script_args", ()))
    raw["command"] = tuple(raw.get("command", ()))
    try:
        return AgentConfig(**raw)
    except TypeError as error:
        raise ConfigError(f"agent configuration {path}: {error}") from None
