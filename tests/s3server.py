"""A real S3 endpoint for tests: moto's standalone server on 127.0.0.1, as a subprocess.

The checkpoint tests write through s3fs/botocore to this server exactly as they would to a
bucket in the cloud; nothing is patched in the test process. ``S3Server.start`` picks a free
loopback port, waits until the server answers HTTP, and ``stop`` ends the process by its PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
KEY = "keepstep-test"
SECRET = "keepstep-test-secret"
REGION = "eu-west-1"  # not us-east-1: s3fs sends it as a LocationConstraint, which that refuses


class S3Server:
    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.endpoint = f"http://{HOST}:{port}"

    @classmethod
    def start(cls, timeout: float = 30.0) -> S3Server:
        """Start a server and wait until it answers; RuntimeError with its log if it does not."""
        deadline = time.monotonic() + timeout
        log = Path(tempfile.mkstemp(prefix="keepstep-moto-", suffix=".log")[1])
        for _ in range(3):  # the free port can be taken between probing and binding it
            port = _free_port()
            with log.open("ab") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
            server = cls(process, port, log)
            while time.monotonic() < deadline and process.poll() is None:
                if server._answers():
                    return server
                time.sleep(0.1)
            server.stop()
            if time.monotonic() >= deadline:
                break
        raise RuntimeError(f"moto S3 server did not answer within {timeout} s:\n{log.read_text()}")

    def storage_options(self) -> dict[str, Any]:
        """What s3fs needs to reach this server (and never a real AWS endpoint)."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "config_kwargs": {
                "connect_timeout": 5,
                "read_timeout": 30,
                "retries": {"max_attempts": 1},
            },
        }

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)

    def _answers(self) -> bool:
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
        try:
            with direct.open(self.endpoint + "/", timeout=1) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
