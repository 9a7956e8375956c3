"""Which etcd binary a private server runs, and the lowest etcd version that works.

Where it sits: `keepstep run` (launch/cli.py), the test session (tests/conftest.py) and the
chaos cluster call `find_etcd(env)` with the environment they were started in, then hand
the path to `etcd_server.EtcdServer` or `etcd_cluster.EtcdCluster`. It picks
$KEEPSTEP_ETCD_BIN, else `etcd` on PATH if it is at least `MIN_VERSION`, else the newest
such build under the cache that `scripts/build-etcd` fills. A named binary is taken as it
is; if it is older than that, it refuses our flags at start, and `EtcdServer` then says
which version it found and the lowest that works (`too_old`).

Any etcd from 3.4.0 on works, so a distribution's package (Debian 12's `etcd-server` is
3.4.23) or a release binary will do. What sets the floor is the server we start: the flags
of `etcd_server.member_args` (`--log-level`, and `--logger=zap`, without which 3.4 logs
every raft step whatever the level) and the `etcd_server_is_leader` metric that
`etcd_cluster.EtcdCluster.leader` reads are all new in 3.4.0. The client
(`keepstep.agent.kv.etcd`) asks for less: KV range/put/delete, a one-compare txn on
create_revision or mod_revision, lease grant, revoke and keepalive streams, and watch
streams from a start revision (no prev_kv, no progress notifications, no fragments), all
in etcd's v3 API by 3.3.

KEEPSTEP_ETCD was this variable's name; it still works, with a warning, because the agent
read the same name as the endpoints (now KEEPSTEP_ETCD_ENDPOINTS).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from keepstep.errors import ConfigError

__all__ = [
    "BIN_ENV",
    "HOW_TO_GET",
    "MIN_VERSION",
    "OLD_BIN_ENV",
    "cache_dir",
    "etcd_version",
    "find_etcd",
    "is_executable",
    "named_binary",
    "too_old",
]

MIN_VERSION = (3, 4, 0)  # see the module docstring
BIN_ENV = "KEEPSTEP_ETCD_BIN"
OLD_BIN_ENV = "KEEPSTEP_ETCD"  # deprecated
HOW_TO_GET = (
    "your distribution's package (Debian, Ubuntu: apt-get install etcd-server), a release "
    "binary (github.com/etcd-io/etcd/releases) on PATH, or KEEPSTEP_ETCD_BIN=/path/to/etcd; "
    "from a keepstep checkout, scripts/build-etcd builds one into the cache"
)
_VERSION = re.compile(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)")

log = logging.getLogger(__name__)


def find_etcd(env: Mapping[str, str]) -> str:
    """The etcd binary to run: $KEEPSTEP_ETCD_BIN (or the deprecated $KEEPSTEP_ETCD), else
    `etcd` on PATH if it is at least `MIN_VERSION`, else the newest such build that
    `scripts/build-etcd` put in the cache. A ConfigError names what was tried and the ways
    to get one."""
    named = named_binary(env)
    if named is not None:  # not second-guessed; a too old one says so if it fails to start
        variable, binary = named
        if not is_executable(Path(binary)):
            raise ConfigError(f"{variable}={binary!r} is not an executable file")
        return binary
    wanted = _dotted(MIN_VERSION)
    tried = []
    on_path = shutil.which("etcd", path=env.get("PATH", os.defpath))
    if on_path is None:
        tried.append("no `etcd` on PATH")
    else:
        version = etcd_version(on_path)
        if version is not None and version >= MIN_VERSION:
            return on_path
        shown = "unknown" if version is None else _dotted(version)
        tried.append(f"{on_path} is version {shown}, older than {wanted}")
    cache = cache_dir(env) / "bin"
    builds = []
    for path in cache.glob("etcd-v*/etcd"):
        match = re.fullmatch(r"etcd-v(\d+)\.(\d+)\.(\d+)", path.parent.name)
        if match and is_executable(path):
            version = (int(match[1]), int(match[2]), int(match[3]))
            if version >= MIN_VERSION:
                builds.append((version, str(path)))
    if builds:
        return max(builds)[1]
    tried.append(f"no build >= {wanted} under {cache}/etcd-v*/etcd")
    raise ConfigError(
        f"no etcd >= {wanted} found ({'; '.join(tried)}); any of these works: {HOW_TO_GET}"
    )


def named_binary(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, path) of the etcd binary the environment names, if it names one.
    KEEPSTEP_ETCD_BIN wins; the deprecated KEEPSTEP_ETCD is still read, with a warning."""
    new, old = env.get(BIN_ENV), env.get(OLD_BIN_ENV)
    if old and new and old != new:
        log.warning(
            "%s=%s is ignored: %s is set, and %s is deprecated",
            OLD_BIN_ENV,
            old,
            BIN_ENV,
            OLD_BIN_ENV,
        )
    elif old and not new:
        log.warning(
            "%s is deprecated as the name of the etcd binary; set %s=%s instead",
            OLD_BIN_ENV,
            BIN_ENV,
            old,
        )
        return OLD_BIN_ENV, old
    return (BIN_ENV, new) if new else None


def too_old(binary: str) -> str | None:
    """Why `binary` cannot serve keepstep, if it is an etcd older than `MIN_VERSION` (the
    version found, the lowest that works, how to get one); None if it is recent enough or
    names no version. Asked only once a server failed to start: an older etcd refuses the
    flags `etcd_server.member_args` passes, and the answer says why."""
    version = etcd_version(binary)
    if version is None or version >= MIN_VERSION:
        return None
    return (
        f"{binary} is etcd {_dotted(version)}, and keepstep needs etcd >= "
        f"{_dotted(MIN_VERSION)}: {HOW_TO_GET}"
    )


def etcd_version(binary: str, timeout: float = 10.0) -> tuple[int, int, int] | None:
    """The version `binary --version` reports, or None if it does not say."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, timeout=timeout, check=False
        ).stdout.decode(errors="replace")
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION.search(out)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3]))


def cache_dir(env: Mapping[str, str]) -> Path:
    """${KEEPSTEP_CACHE:-${XDG_CACHE_HOME:-~/.cache}/keepstep}, as scripts/build-etcd uses."""
    if env.get("KEEPSTEP_CACHE"):
        return Path(env["KEEPSTEP_CACHE"])
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "keepstep"


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
