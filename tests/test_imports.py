"""What each room of keepstep imports, checked in a fresh interpreter.

import-linter (run by scripts/test) checks the import graph statically; these check what
actually gets loaded, which also covers a package `__init__` that would pull in torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "keepstep",
    "keepstep.errors",
    "keepstep.fatal",
    "keepstep.agent.protocol",
    "keepstep.agent.protocol.events",
    "keepstep.agent.protocol.recovery",
    "keepstep.agent.protocol.link",
    "keepstep.agent.kv",
    "keepstep.agent.kv.memory",
    "keepstep.agent.kv.etcd",
    "keepstep.agent.kv.etcd_auth",
    "keepstep.agent.kv.etcd_pki",
    "keepstep.launch.etcd_tls",
    "keepstep.elastic.shard",
    "keepstep.elastic.speed",
    "keepstep.dashboard.cli",
    "keepstep.dashboard.data",
    "keepstep.dashboard.server",
    "keepstep.chaos.cli",
    "keepstep.chaos.runner",
    "keepstep.chaos.inject",
    "keepstep.chaos.local",
    "keepstep.cli",
    "keepstep.launch.cli",
    "keepstep.argtypes",
    "keepstep.resources",
    "keepstep.checkpoint",
    "keepstep.checkpoint.cli",
    "keepstep.checkpoint.catalog",
]

HEAVY = ("torch", "numpy", "numba")


def _loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(done.stdout.split())


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert not loaded & set(HEAVY), f"{module} pulled in {sorted(loaded & set(HEAVY))}"


@pytest.mark.parametrize(
    "command", ["dashboard --help", "chaos --help", "checkpoint --help", "--help"]
)
def test_tool_help_starts_without_torch(command: str) -> None:
    argv = ["keepstep", *command.split()]
    code = (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n"
        "    runpy.run_module('keepstep', run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code"
    )
    loaded = _loaded_after(code)
    assert "keepstep.cli" in loaded
    assert not loaded & set(HEAVY), f"keepstep {command} pulled in {sorted(loaded & set(HEAVY))}"


def test_the_library_names_resolve_on_use() -> None:
    """`keepstep.elastic` imports torch only when a training name is used."""
    loaded = _loaded_after("import keepstep.elastic.errors, keepstep.elastic.snapshot_layout")
    assert "torch" not in loaded
    loaded = _loaded_after("import keepstep\nkeepstep.init")
    assert {"torch", "keepstep.elastic.api", "keepstep.elastic.job"} <= loaded


def test_the_node_agent_starts_without_torch_or_opentelemetry() -> None:
    """What a node agent imports before it starts its workers: neither torch (~2 s; it
    comes once they run, for the store) nor OpenTelemetry's SDK (only with telemetry on)."""
    loaded = _loaded_after(
        "import keepstep.agent.node.main, keepstep.agent.node.cli, keepstep.agent.kv.etcd"
    )
    assert "keepstep.agent.node.agent" in loaded
    heavy = {m for m in loaded if m in HEAVY or m.startswith("opentelemetry.sdk")}
    assert not heavy, sorted(heavy)


def test_the_operator_imports_only_the_agents_protocol_and_kv() -> None:
    loaded = _loaded_after("import keepstep.operator.handlers, keepstep.operator.__main__")
    agent = {m for m in loaded if m.startswith("keepstep.agent.")}
    allowed = ("keepstep.agent.protocol", "keepstep.agent.kv")
    assert agent and all(m.startswith(allowed) for m in agent), sorted(agent)
    assert "torch" not in loaded
