"""The node agent's configuration: what `keepstep run` (or a pod's entrypoint) hands it.

It travels as a JSON file, so that a node's whole setup is visible in its run directory.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keepstep.agent.node.supervisor import WorkerSpec
from keepstep.elastic.errors import ConfigError


@dataclass(frozen=True)
class AgentConfig:
    job: str
    node: str
    etcd: str
    script: str
    script_args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()  # a worker's whole command line (else python SCRIPT ARGS)
    nproc: int = 1
    run_dir: Path = Path(".")
    worker_env: dict[str, str] = field(default_factory=dict)
    expected_nodes: int = 1
    min_nodes: int = 1
    lease_ttl: float = 1.0
    probe_timeout: float = 0.3
    admission_grace: float = 30.0
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


def snapshot_path(cfg: AgentConfig, member: str) -> Path:
    """The worker's snapshot file: node-local shared memory that outlives the worker."""
    return cfg.snapshot_dir / f"keepstep-{cfg.job}-{member.replace('/', '-')}"


def worker_spec(cfg: AgentConfig, member: str, link: str, snapshot: Path) -> WorkerSpec:
    """How to start one training process: the script, and the job's settings in its env."""
    env = dict(os.environ)
    env.update(cfg.worker_env)
    env.update(
        KEEPSTEP_CONTROLLER="keepstep.agent.worker.controller:controller_from_env",
        KEEPSTEP_LINK=link,
        KEEPSTEP_MEMBER=member,
        KEEPSTEP_SNAPSHOT=str(snapshot),
        OMP_NUM_THREADS="1",
    )
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
    for name in ("run_dir", "snapshot_dir", "resume_blob"):
        if raw.get(name) is not None:
            raw[name] = Path(raw[name])
    raw["script_args"] = tuple(raw.get("script_args", ()))
    raw["command"] = tuple(raw.get("command", ()))
    try:
        return AgentConfig(**raw)
    except TypeError as error:
        raise ConfigError(f"agent configuration {path}: {error}") from None
