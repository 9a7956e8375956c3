"""Durable checkpoints in storage: the layout under a URL, its records, and the fsspec calls.

Where it sits: under ``checkpoint`` (the writer, and the public names) and
``checkpoint_read`` (the readers); both reach storage only through the ``Store`` here, so this
is the one module that talks to object storage. The layout under the URL (a directory, or a
prefix in an object store)::

    step-00000042.ckpt   the blob: a verified snapshot slot (header + payload)
    step-00000042.json   its CheckpointInfo, with the blob's sha256
    latest.json          the CheckpointInfo of the newest complete checkpoint, written last

Object stores publish each object whole; on a local filesystem each file goes to a temporary
name, is fsynced and renamed. fsspec calls take no timeout, so callers that must not hang run
them through ``bounded``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from keepstep.elastic.errors import ConfigError, SnapshotCorrupt

__all__ = [
    "LATEST",
    "TMP_FILE",
    "CheckpointInfo",
    "Location",
    "Store",
    "blob_name",
    "bounded",
    "check_int",
    "check_timeout",
    "info_name",
    "step_files",
]

LATEST = "latest.json"
_FORMAT = 1
_STEP_FILE = re.compile(r"step-(\d{8,})\.(ckpt|json)")
_TMP = ".tmp-"
TMP_FILE = re.compile(r"(step-\d{8,}\.(ckpt|json)|latest\.json)\.tmp-\d+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")


def blob_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def info_name(step: int) -> str:
    return f"step-{step:08d}.json"


def step_files(names: list[str]) -> dict[int, set[str]]:
    """The checkpoint files among ``names``, by step."""
    by_step: dict[int, set[str]] = {}
    for name in names:
        m = _STEP_FILE.fullmatch(name)
        if m:
            by_step.setdefault(int(m.group(1)), set()).add(name)
    return by_step


@dataclass(frozen=True)
class CheckpointInfo:
    url: str  # of the blob
    step: int
    nbytes: int
    sha256: str
    written_at: float  # time.time() when the blob was in storage

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"url={self.url!r}: must be a non-empty str")
        check_int("step", self.step, 0)
        check_int("nbytes", self.nbytes, 0)
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):
            raise ConfigError(f"sha256={self.sha256!r}: must be 64 lowercase hex digits")
        w = self.written_at
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"written_at={w!r}: must be a finite time in seconds >= 0")

    def to_json(self) -> bytes:
        return json.dumps({"format": _FORMAT, **dataclasses.asdict(self)}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> CheckpointInfo:
        """Parse a record; anything malformed is SnapshotCorrupt naming ``where``."""
        try:
            record = json.loads(raw)
            if record["format"] != _FORMAT:
                raise ValueError(f"format {record['format']!r}, this build reads {_FORMAT}")
            return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls)})
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotCorrupt(f"{where}: not a checkpoint record ({e})") from None


@dataclass(frozen=True)
class Location:
    """A checked URL; parsing does no I/O (some filesystems connect when instantiated)."""

    url: str  # without a trailing slash
    options: dict[str, Any]

    @classmethod
    def parse(cls, url: str, storage_options: Mapping[str, Any] | None) -> Location:
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"url={url!r}: must be a non-empty fsspec URL such as file:///dir")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ConfigError(f"storage_options={storage_options!r}: must be a mapping or None")
        if "::" in url:
            raise ConfigError(f"url={url!r}: chained URLs are not supported; name one store")
        protocol = fsspec.core.split_protocol(url)[0] or "file"
        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ConfigError(
                f"url={url!r}: unknown protocol {protocol!r}; use file://, s3:// or another "
                "fsspec protocol"
            ) from None
        except ImportError as e:
            raise ConfigError(f"url={url!r}: the {protocol} backend is not installed ({e})") from e
        if str(fs_class._strip_protocol(url)).rstrip("/") == "":
            raise ConfigError(f"url={url!r}: names no directory (s3://bucket/prefix, file:///dir)")
        return cls(url.rstrip("/"), dict(storage_options or {}))

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"


class Store:
    """The filesystem behind a location, made in the thread that does the I/O."""

    def __init__(self, loc: Location) -> None:
        self.fs, root = fsspec.core.url_to_fs(loc.url, **loc.options)
        self.root = str(root).rstrip("/")
        self.url = loc.url
        self._local = isinstance(self.fs, LocalFileSystem)
        self.fs.invalidate_cache(self.root)  # another process may have written since

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def names(self) -> list[str]:
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in paths]

    def get(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(f"{self.root}/{name}"))

    def put(self, name: str, data: bytes) -> None:
        if self._local:
            _put_local(self.root, name, data)
        else:
            self.fs.pipe_file(f"{self.root}/{name}", data)  # an object appears whole or not

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.root}/{name}")


def _put_local(directory: str, name: str, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: the file is whole under its name or absent,
    and it survives a power loss in the order written."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = f"{path}{_TMP}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bounded(fn: Callable[[], _T], timeout: float, what: str) -> _T:
    """Run blocking I/O with a deadline. fsspec calls take none, so the call runs on a daemon
    thread that is abandoned on timeout."""
    result: Future[_T] = Future()

    def run() -> None:
        try:
            result.set_result(fn())
        except BaseException as e:
            result.set_exception(e)

    threading.Thread(target=run, name="keepstep-checkpoint-read", daemon=True).start()
    try:
        return result.result(timeout)
    except TimeoutError:
        if result.done():
            raise  # the I/O itself timed out
        raise TimeoutError(f"{what}: no answer after {timeout} s") from None


def check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an int >= {minimum}")


def check_timeout(timeout: float) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigError(f"timeout={timeout!r}: must be a number of seconds > 0")


def storage_options_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """fsspec options for durable checkpoints from the environment: KEEPSTEP_S3_ENDPOINT
    names an S3-compatible endpoint (credentials come from AWS_* as usual)."""
    endpoint = env.get("KEEPSTEP_S3_ENDPOINT")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
