"""The node agent's process: its SIGTERM (a drain), its wait, its exit status.

A SIGTERM drains the node: it leaves the job at the next step boundary (NodeAgent.drain).
The kernel may hand a process's signal to any of its threads, while Python runs the
handler only on the main thread when that next runs Python code: so the main thread waits
for the end in slices, or a SIGTERM caught by another thread (an etcd watch, the
supervisor) would wait until the workers end, and the drain would come too late.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from keepstep.agent.kv import KVStore
from keepstep.agent.node.agent import NodeAgent
from keepstep.agent.node.config import AgentConfig

if TYPE_CHECKING:  # OpenTelemetry's SDK is imported only when telemetry is on
    from keepstep.agent.telemetry.otel import Telemetry

log = logging.getLogger(__name__)

SIGNAL_SLICE_S = 0.2  # how soon a signal another thread caught runs its handler
TERMINATION_LOG_MAX_BYTES = 4096  # what the kubelet keeps of a termination message


def run_agent(cfg: AgentConfig, kv: KVStore, telemetry: Telemetry | None = None) -> int:
    """Run until every worker has finished (0), or the job cannot go on (1)."""
    agent = NodeAgent(cfg, kv, telemetry)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=agent.drain).start())
    agent.start()
    try:
        # In slices: a handler runs only when the main thread runs (the docstring).
        while not agent.done.wait(SIGNAL_SLICE_S):
            pass
    finally:
        agent.close()
    ok = agent.failed is None and agent.workers.ended_well()
    if not ok:
        why = agent.failed or agent.workers.exit_codes()
        print(f"keepstep agent {cfg.node}: {why}", file=sys.stderr)
        if cfg.termination_log is not None:
            write_termination_log(cfg.termination_log, f"keepstep agent {cfg.node}: {why}")
    return 0 if ok else 1


def write_termination_log(path: Path, message: str) -> None:
    """Write `message` (cut to what the kubelet keeps) for the container's status; a log
    that cannot be written loses only the message (the exit status still says failed)."""
    data = message.encode(errors="replace")[:TERMINATION_LOG_MAX_BYTES]
    try:
        path.write_bytes(data)
    except OSError as error:
        log.warning("termination log %s not written: %s", path, error)
