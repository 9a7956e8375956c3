"""The configuration of `keepstep run`, checked whole when it is made.

Where it sits: `launch.cli` builds a `RunConfig` from the command line (the chaos harness and
tests build one directly) and hands it to `run.Launcher`. Every rule that involves more than
one flag is checked here, at construction and before anything starts, and each message
names the flags and values: the batch arithmetic (every worker gets at least one
micro-batch), the faults against the nodes and steps, the checkpoint flags. Values the
workers would refuse (seed, mode) are refused here too: a worker that exits at once would be
restarted `--max-restarts` times before the run failed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepstep.elastic.plan import micro_batch_count
from keepstep.elastic.slow_drain import FORM, DrainSlow
from keepstep.errors import ConfigError
from keepstep.launch.etcd_cluster import MEMBER_COUNTS
from keepstep.launch.faults import FaultKind, FaultSpec, check_faults
from keepstep.launch.netns import MAX_NODES

# keepstep.elastic.config.Balance's values, spelled out: importing it would import torch
# into the launcher, which checks its flags without it (a test keeps the two equal).
BALANCES = ("off", "speed")


@dataclass(frozen=True)
class RunConfig:
    script: str
    script_args: tuple[str, ...]
    nodes: int
    global_batch: int
    micro_batch: int
    steps: int
    run_dir: Path
    etcd_binary: str
    nproc_per_node: int = 1
    min_nodes: int = 1
    admission_grace: float = 30.0  # the first epoch waits this long for all nodes
    seed: int = 0
    mode: str = "exact"
    faults: tuple[FaultSpec, ...] = ()
    timeout: float = 1800.0
    lease_ttl: float = 1.0
    heartbeat_timeout: float = 0.5  # 0: off (AgentConfig.heartbeat_timeout)
    warm_spare: bool = False
    extra_env: Mapping[str, str] = field(default_factory=dict)
    checkpoint_url: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    netns: bool = False  # each node in its own network namespace (root and `ip` needed)
    etcd_members: int = 1  # 3: a cluster that survives the loss of one member
    module: bool = False  # `script` names a module, run as `python -m script` (torchrun's -m)
    max_restarts: int = 3  # a crashed worker is restarted this many times in a row at most
    balance: str = "off"  # "speed": the plan follows the members' measured speed
    drain_slow: str | None = None  # "BELOW:STEPS": drain a node whose member stays too slow

    def __post_init__(self) -> None:
        gb, mb = self.global_batch, self.micro_batch
        if not (_whole(gb, 1) and _whole(mb, 1)) or gb % mb:
            raise ConfigError(
                f"--global-batch {gb!r} must be a multiple of --micro-batch {mb!r} (both >= 1): "
                "every step trains the same whole number of micro-batches"
            )
        n_micro = micro_batch_count(self.global_batch, self.micro_batch)
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ConfigError(
                f"--nnodes {self.nodes} and --nproc-per-node {self.nproc_per_node} must be >= 1"
            )
        joins = sum(1 for f in self.faults if f.kind is FaultKind.JOIN_NODE)
        workers = (self.nodes + joins) * self.nproc_per_node
        if workers > n_micro:
            raise ConfigError(
                f"{workers} workers ((--nnodes {self.nodes} + {joins} joins) x --nproc-per-node "
                f"{self.nproc_per_node}) but only {n_micro} micro-batches "
                f"(--global-batch {self.global_batch} / --micro-batch {self.micro_batch}); "
                "every worker needs at least one"
            )
        if not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(
                f"--min-nodes {self.min_nodes} must be between 1 and --nnodes {self.nodes}"
            )
        if not _seconds(self.admission_grace) or self.admission_grace < 0:
            raise ConfigError(
                f"--admission-grace {self.admission_grace!r} must be a number of seconds >= 0"
            )
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps} must be >= 1")
        if not _whole(self.seed, 0):
            raise ConfigError(f"--seed {self.seed!r} must be an integer >= 0")
        if self.mode not in ("exact", "fast"):
            raise ConfigError(f"--mode {self.mode!r}; allowed: exact, fast")
        if not _seconds(self.timeout) or self.timeout <= 0:
            raise ConfigError(f"--timeout {self.timeout!r} must be a number of seconds > 0")
        if not _whole(self.max_restarts, 0):
            raise ConfigError(f"--max-restarts {self.max_restarts!r} must be an integer >= 0")
        if self.module:
            if not all(part.isidentifier() for part in self.script.split(".")):
                raise ConfigError(f"-m {self.script!r} is not a module name such as pkg.train")
        elif not Path(self.script).is_file():
            raise ConfigError(f"training script {self.script!r} does not exist")
        if self.balance not in BALANCES:
            raise ConfigError(f"balance {self.balance!r}; allowed: {', '.join(BALANCES)}")
        if self.drain_slow is not None:
            try:
                DrainSlow.parse(self.drain_slow)
            except ConfigError:
                raise ConfigError(f"--drain-slow {self.drain_slow!r} is not {FORM}") from None
        check_faults(self.faults, self.nodes, self.steps)
        if self.lease_ttl < 1:
            raise ConfigError(f"--hang-timeout {self.lease_ttl} must be >= 1 second")
        if not (math.isfinite(self.heartbeat_timeout) and self.heartbeat_timeout >= 0):
            raise ConfigError(
                f"--heartbeat-timeout {self.heartbeat_timeout} must be >= 0 seconds (0: off)"
            )
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every} must be >= 0")
        if self.checkpoint_every and not self.checkpoint_url:
            raise ConfigError("--checkpoint-every needs --checkpoint URL")
        if self.etcd_members not in MEMBER_COUNTS:
            raise ConfigError(
                f"--etcd-members {self.etcd_members}; allowed: "
                + ", ".join(map(str, MEMBER_COUNTS))
            )
        if self.netns and self.nodes + joins > MAX_NODES:
            raise ConfigError(
                f"--netns gives each node an address of one /24: at most {MAX_NODES} nodes "
                f"(--nnodes {self.nodes} + {joins} joins)"
            )

    def balance_env(self) -> dict[str, str]:
        """What the workers' `keepstep.init` reads for `balance` and `drain_slow`: set only
        when on, so a script that passes balance="speed" itself still runs without
        --balance."""
        env = {"KEEPSTEP_BALANCE": self.balance} if self.balance != "off" else {}
        if self.drain_slow is not None:
            env["KEEPSTEP_DRAIN_SLOW"] = str(DrainSlow.parse(self.drain_slow))
        return env


def _seconds(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object, minimum: int) -> bool:
    """An int (not a bool) >= minimum."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
