"""Settings and fixtures for the whole test session.

A real etcd is started once per session on loopback (`etcd_server`) and shared by every
test that needs one; each works under its own key prefix. $KEEPSTEP_ETCD_BIN names the
binary (see `etcd_binary`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from keepstep.errors import ConfigError
from keepstep.launch.etcd_binary import BIN_ENV, OLD_BIN_ENV, find_etcd
from keepstep.launch.etcd_server import EtcdServer

REPO = Path(__file__).resolve().parents[1]

# Tests press Ctrl-C on the processes they start (SIGINT). A shell that runs the suite in
# the background (`.ci/run &`) starts it with SIGINT ignored, and every child would inherit
# that and never see the key. A handler, unlike "ignored", is reset to the default in a
# child at exec, so the processes under test get Ctrl-C as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# A multi-process test (marked slow) that sets no time limit of its own gets this one
# instead of the session's 120 s: CI runs two test sessions at once on a small machine, and
# such a test may then take twice its time on an idle one.
SLOW_TIMEOUT = 300.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    """The etcd to test against: $KEEPSTEP_ETCD_BIN (scripts/test sets it), else the version
    the tests pin (scripts/build-etcd), else any that `keepstep run` would find (such as a
    distribution's 3.4 on PATH), else the pinned one, built now."""
    if os.environ.get(BIN_ENV) or os.environ.get(OLD_BIN_ENV):
        return find_etcd(os.environ)  # checked; the deprecated name is still read
    build = [str(REPO / "scripts" / "build-etcd")]
    pinned = subprocess.run([*build, "--print-path"], capture_output=True, text=True, check=False)
    if pinned.returncode == 0:
        return pinned.stdout.strip().splitlines()[-1]
    try:
        return find_etcd(os.environ)
    except ConfigError:
        pass
    # A cold build takes about 1.5 minutes; nothing is skipped for want of a binary.
    done = subprocess.run(build, capture_output=True, text=True, timeout=900, check=False)
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
