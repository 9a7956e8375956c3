"""The configuration of one node's agent on Ray: what `keepstep run` writes for a node.

Where it sits: `launcher.RayLauncher` calls `agent_config` (the local launcher's own,
`keepstep.launch.run.agent_config`, from the same `RunConfig`) once a node's actor is
placed and has said its address; the actor writes it (`config_json`) to agent-<node>.json
in the run directory and starts `keepstep agent --config` on it. Only the node's address
comes from Ray (the agent and its workers publish it).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from keepstep.agent.node.config import AgentConfig
from keepstep.launch.run import agent_config

__all__ = ["agent_config", "config_json"]


def config_json(agent: AgentConfig) -> str:
    """`agent` as the JSON `keepstep agent --config` reads (the layout of
    `keepstep.agent.node.config.dump_config`, which writes to a file on this machine)."""
    data = asdict(agent)
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in data.items()})
