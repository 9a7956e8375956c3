"""A worker that stopped on an error no restart mends tells its node agent so.

A training script that ends on a `ConfigError` (its settings disagree with the launcher's,
a step without `step.commit()`, a model keepstep refuses) would end the same way after any
restart: the agent should fail the job with that message at once rather than restart the
worker until its restart budget is spent, on every node. The agent names a file in
``KEEPSTEP_FATAL``; `keepstep.init` installs `install_hook`, which writes the error there
when it ends the process uncaught, and the agent reads it (`read_fatal`) when the worker
exits. The file is plain JSON of two strings, read with a size limit and checked: it is
never trusted beyond being a message to show.

Importable without torch (the agent reads it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from keepstep.errors import ConfigError

__all__ = ["FATAL_ENV", "install_hook", "read_fatal", "write_fatal"]

FATAL_ENV = "KEEPSTEP_FATAL"
_MAX_MESSAGE = 4000  # characters kept of the error's message
_MAX_FILE = 16384  # bytes read back

_installed = threading.Lock()
_hooked: list[Path] = []  # the file the installed hook writes (one hook per process)

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


def write_fatal(path: Path, error: BaseException) -> None:
    """Record `error` in `path` for the agent (best effort: the process is ending)."""
    record = {"error": type(error).__name__, "message": str(error)[:_MAX_MESSAGE]}
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass


def read_fatal(path: Path) -> str | None:
    """What a worker recorded in `path` ("ConfigError: ..."), or None if nothing usable."""
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_FILE + 1)
    except OSError:
        return None
    if len(raw) > _MAX_FILE:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    error, message = record.get("error"), record.get("message")
    if not isinstance(error, str) or not isinstance(message, str) or not error.isidentifier():
        return None
    return f"{error}: {message[:_MAX_MESSAGE]}"


def install_hook(env: Mapping[str, str]) -> None:
    """Where the launcher named a file (``KEEPSTEP_FATAL``), have an uncaught ConfigError
    (or one the uncaught error was raised from) recorded there before the usual traceback.
    Once per process; the hook before it still runs."""
    where = env.get(FATAL_ENV)
    if not where:
        return
    with _installed:
        if _hooked:
            return
        _hooked.append(Path(where))
        previous: ExceptHook = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
            config = _config_error(error)
            if config is not None:
                write_fatal(_hooked[0], config)
            previous(kind, error, tb)

        sys.excepthook = hook


def _config_error(error: BaseException | None) -> ConfigError | None:
    seen = 0
    while error is not None and seen < 32:  # the cause chain, bounded
        if isinstance(error, ConfigError):
            return error
        error = error.__cause__  # what it was raised from; not one merely being handled
        seen += 1
    return None
