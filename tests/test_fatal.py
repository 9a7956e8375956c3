"""keepstep/fatal.py: a worker that ends on a ConfigError records it for its agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keepstep.fatal import FATAL_ENV, read_fatal

ENDINGS = {
    "config": "raise ConfigError('global_batch=48: bad')",
    "caused": "raise RuntimeError('wrapped') from ConfigError('micro_batch=0: bad')",
    "other": "raise RuntimeError('a bug of the script')",
    "handled": "try:\n    raise ConfigError('x')\nexcept ConfigError:\n    raise KeyError('k')",
    "clean": "pass",
}


def _end(tmp_path: Path, ending: str, hooked: bool = True) -> tuple[int, str, str | None]:
    path = tmp_path / "fatal.json"
    script = "\n".join(
        (
            "import os, sys",
            "from keepstep.errors import ConfigError",
            "from keepstep.fatal import install_hook",
            "install_hook(os.environ)",
            "install_hook(os.environ)  # twice: one hook",
            ENDINGS[ending],
        )
    )
    env = {k: v for k, v in os.environ.items() if k != FATAL_ENV}
    if hooked:
        env[FATAL_ENV] = str(path)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    return proc.returncode, proc.stderr, read_fatal(path)


@pytest.mark.parametrize(
    ("ending", "recorded"),
    [
        ("config", "ConfigError: global_batch=48: bad"),
        ("caused", "ConfigError: micro_batch=0: bad"),
        ("other", None),
        ("handled", None),  # a ConfigError being handled is not what ended the script
        ("clean", None),
    ],
)
def test_an_uncaught_config_error_is_recorded_and_the_traceback_still_shown(
    tmp_path: Path, ending: str, recorded: str | None
) -> None:
    code, stderr, found = _end(tmp_path, ending)
    assert found == recorded
    assert code == (0 if ending == "clean" else 1)
    if ending != "clean":
        assert stderr.count("Traceback (most recent call last)") >= 1  # the usual report


def test_without_the_launchers_file_nothing_is_written(tmp_path: Path) -> None:
    code, _, found = _end(tmp_path, "config", hooked=False)
    assert (code, found) == (1, None)
    assert not (tmp_path / "fatal.json").exists()


def test_only_a_well_formed_record_is_read(tmp_path: Path) -> None:
    path = tmp_path / "fatal.json"
    assert read_fatal(path) is None  # absent
    for bad in (
        b"not json",
        b"[1, 2]",
        json.dumps({"error": "ConfigError"}).encode(),
        json.dumps({"error": "no spaces allowed", "message": "m"}).encode(),
        json.dumps({"error": "ConfigError", "message": 3}).encode(),
        json.dumps({"error": "ConfigError", "message": "m" * 20000}).encode(),  # too large
    ):
        path.write_bytes(bad)
        assert read_fatal(path) is None, bad
    path.write_text(json.dumps({"error": "ConfigError", "message": "steps=-1: bad"}))
    assert read_fatal(path) == "ConfigError: steps=-1: bad"
