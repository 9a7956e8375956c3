"""Fixtures shared by the node agent's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from keepstep.agent.kv.memory import MemoryKV
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Callable[..., NodeAgent]]:
    """Start NodeAgents on one MemoryKV (each its own client), whose workers never say
    hello themselves (`sleep`): the test speaks for them over their links. Keywords go to
    each agent's `AgentConfig`; every agent started is closed at the end."""
    kv = MemoryKV()
    started: list[NodeAgent] = []

    def start(job: str, node: str, **kw: Any) -> NodeAgent:
        cfg = AgentConfig(
            job=job,
            node=node,
            etcd="",
            script="",
            command=("sleep", "60"),
            run_dir=tmp_path,
            snapshot_dir=tmp_path,
            **kw,
        )
        agent = NodeAgent(cfg, kv.client())
        agent.start()
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.close()
