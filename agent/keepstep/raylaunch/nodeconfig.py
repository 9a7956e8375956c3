"""The configuration of one node's agent on Ray: what `keepstep run` writes for a node.

Where it sits: `launcher.RayLauncher` calls `agent_config` once a node's actor is
placed and has said its address; the actor writes it (`config_json`) to agent-<node>.json in the
run directory and starts `keepstep agent --config` on it. The fields are those the local
launcher fills (`keepstep.launch.run.Launcher._start_node`), from the same `RunConfig`;
only the node's address comes from Ray (the agent and its workers publish it).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from keepstep.agent.node.config import AgentConfig, worker_env
from keepstep.launch.run_config import RunConfig


def agent_config(
    cfg: RunConfig,
    *,
    job: str,
    node: str,
    etcd: str,
    etcd_tls: Path | None,
    host: str,
    expected_nodes: int,
    resume_blob: Path | None,
    resume_step: int,
) -> AgentConfig:
    return AgentConfig(
        job=job,
        node=node,
        etcd=etcd,
        etcd_tls=None if etcd_tls is None else etcd_tls.resolve(),
        script=cfg.script if cfg.module else str(Path(cfg.script).resolve()),
        script_args=cfg.script_args,
        command=(sys.executable, "-m", cfg.script, *cfg.script_args) if cfg.module else (),
        max_restarts=cfg.max_restarts,
        nproc=cfg.nproc_per_node,
        run_dir=cfg.run_dir.resolve(),
        worker_env=worker_env(
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            steps=cfg.steps,
            seed=cfg.seed,
            mode=cfg.mode,
            host=host,
            extra=cfg.extra_env,
        ),
        expected_nodes=expected_nodes,
        min_nodes=min(cfg.min_nodes, expected_nodes),
        lease_ttl=cfg.lease_ttl,
        heartbeat_timeout=cfg.heartbeat_timeout,
        warm_spare=cfg.warm_spare,
        steps=cfg.steps,
        checkpoint_url=cfg.checkpoint_url,
        checkpoint_every=cfg.checkpoint_every,
        storage_options=dict(cfg.storage_options),
        resume_blob=resume_blob,
        resume_step=resume_step,
        host=host,
    )


def config_json(agent: AgentConfig) -> str:
    """`agent` as the JSON `keepstep agent --config` reads (the layout of
    `keepstep.agent.node.config.dump_config`, which writes to a file on this machine)."""
    data = asdict(agent)
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in data.items()})
