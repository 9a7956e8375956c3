"""Fixtures for the agent's tests: a real etcd, started once per session on loopback."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.agent.etcd_server import EtcdServer, find_etcd
from keepstep.elastic.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    """The etcd to test against; built with scripts/build-etcd if there is none yet."""
    try:
        return find_etcd(os.environ)
    except ConfigError:
        pass
    # A cold build takes about 1.5 minutes; nothing is skipped for want of a binary.
    done = subprocess.run(
        [str(REPO / "scripts" / "build-etcd")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/build-etcd failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def etcd_server(etcd_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint ("127.0.0.1:PORT") of an etcd shared by the whole session.

    Tests share it, so each one works under its own key prefix. Tests that kill or
    restart a server start their own with `EtcdServer.start`.
    """
    with EtcdServer.start(etcd_binary, tmp_path_factory.mktemp("etcd")) as server:
        yield server.endpoint
