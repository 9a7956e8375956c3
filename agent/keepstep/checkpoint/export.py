"""Decoded checkpoint state written as files that plain PyTorch (or safetensors) opens.

Where it sits: the last step of `keepstep checkpoint export` (cli.py), after contents.decode.
Two formats:

- ``torch``: one ``torch.save`` of a dict of tensors and plain values only, so that
  ``torch.load(path, weights_only=True)`` opens it::

      {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
       "state": {name: tracked_object.state_dict()}, "step": N,
       "params_sha256": ..., "state_sha256": {name: ...}, "source": URL of the blob}

  A frozenset in tracked state becomes a set (the weights-only loader refuses frozensets).
- ``safetensors``: the model's tensors only, with the file's string metadata ``step``,
  ``params_sha256``, ``source`` and ``tracked_state`` (the names of the tracked objects
  whose state params_sha256 covers but this file does not hold; empty when none);
  needs the safetensors package.

A file is written under a temporary name beside its destination and renamed into place,
so a destination is never left half written.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
from pathlib import Path
from typing import Any

import torch

from keepstep.checkpoint.contents import Contents
from keepstep.errors import ConfigError


class Format(enum.Enum):
    TORCH = "torch"
    SAFETENSORS = "safetensors"


def plain(contents: Contents, source: str) -> dict[str, Any]:
    """What the torch format holds (the module docstring shows it)."""
    return {
        "model": contents.model,
        "optimizer": contents.optimizer,
        "state": {name: _loadable(s) for name, s in contents.state.items()},
        "step": contents.step,
        "params_sha256": contents.params_sha256,
        "state_sha256": contents.state_sha256,
        "source": source,
    }


def write(contents: Contents, source: str, out: Path, fmt: Format, *, force: bool) -> int:
    """Write ``out`` in ``fmt``; the number of bytes written. ConfigError if ``out`` exists
    and not ``force``."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if fmt is Format.TORCH:
            torch.save(plain(contents, source), tmp)
        else:
            # Imported by name: an optional package that need not be installed.
            save_file = importlib.import_module("safetensors.torch").save_file
            meta = {"step": str(contents.step), "params_sha256": contents.params_sha256}
            meta |= {"tracked_state": ",".join(contents.state), "source": source}
            save_file(contents.model, str(tmp), metadata=meta)
        if not force and out.exists():
            raise ConfigError(f"OUT {out}: exists; --force overwrites it")
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return out.stat().st_size


def _loadable(value: Any) -> Any:
    """``value`` with every frozenset made a set, for the weights-only loader."""
    if isinstance(value, frozenset):
        return set(value)
    if isinstance(value, dict):
        return {k: _loadable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_loadable(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_loadable(v) for v in value)
    return value
