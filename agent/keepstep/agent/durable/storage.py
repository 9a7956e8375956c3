"""Durable checkpoints in storage: the layout under a URL, its records, and the fsspec calls.

Where it sits: under ``checkpoint`` (the writer, and the public names) and
``checkpoint_read`` (the readers); both reach storage only through the ``Store`` here, so this
is the one module that talks to object storage. The layout under the URL (a directory, or a
prefix in an object store)::

    step-00000042.ckpt   the blob: a verified snapshot slot (header + payload)
    step-00000042.json   its CheckpointInfo, with the blob's sha256
    latest.json          the CheckpointInfo of the newest complete checkpoint, written last

A sharded job's checkpoint (parts.py) has one part per member, written in parallel, and
its blob is the manifest that lists them (the record's ``parts`` > 0)::

    step-00000042.e0003.part-0001-of-0004.ckpt   member 1's snapshot, of epoch 3's four
    step-00000042.e0003.part-0001-of-0004.json   its CheckpointInfo

Object stores publish each object whole; on a local filesystem each file goes to a temporary
name, is fsynced and renamed. fsspec calls take no timeout, so callers that must not hang run
them through ``bounded``. The command lines check a ``--checkpoint``/``--resume`` URL here
before anything starts: ``check_url`` (a store fsspec can keep files in) and
``check_s3_access`` (credentials an S3 client will find).
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
    "part_name",
    "step_files",
]

LATEST = "latest.json"
_FORMAT = 1  # a record of a whole snapshot
_FORMAT_PARTS = 2  # a record with parts: older builds refuse it by its format
_PART = r"(?:\.e\d{4,}\.part-\d{4,}-of-\d{4,})?"
_STEP_FILE = re.compile(rf"step-(\d{{8,}}){_PART}\.(ckpt|json)")
_TMP = ".tmp-"
# A local file being written (or left by a writer that died mid-file): the step's, or None
# for latest.json.
TMP_FILE = re.compile(rf"(?:step-(\d{{8,}}){_PART}\.(?:ckpt|json)|latest\.json)\.tmp-\d+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")


def blob_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def info_name(step: int) -> str:
    return f"step-{step:08d}.json"


def part_name(step: int, epoch: int, index: int, count: int, ext: str = "ckpt") -> str:
    """The file of member ``index`` of ``count``'s part (``ext`` "json": its record)."""
    return f"step-{step:08d}.e{epoch:04d}.part-{index:04d}-of-{count:04d}.{ext}"


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
    parts: int = 0  # 0: the blob is a snapshot; n: the manifest of n members' parts

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
        check_int("parts", self.parts, 0)

    def to_json(self) -> bytes:
        record = dataclasses.asdict(self)
        if not self.parts:
            del record["parts"]  # as builds before parts wrote it, so they read it
        form = _FORMAT_PARTS if self.parts else _FORMAT
        return json.dumps({"format": form, **record}, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> CheckpointInfo:
        """Parse a record; anything malformed is SnapshotCorrupt naming ``where``."""
        try:
            record = json.loads(raw)
            if record["format"] not in (_FORMAT, _FORMAT_PARTS):
                raise ValueError(
                    f"format {record['format']!r}, this build reads {_FORMAT} and {_FORMAT_PARTS}"
                )
            fields = dataclasses.fields(cls)
            return cls(
                **{
                    f.name: record[f.name]
                    for f in fields
                    if f.name in record or f.default is dataclasses.MISSING
                }
            )
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
        """The names under the root as storage lists them now. A listing cache (s3fs keeps
        one per filesystem, never expiring) would hide what other processes wrote since,
        such as a sharded step's parts from other agents, so it is dropped first."""
        self.fs.invalidate_cache(self.root)
        try:
            paths = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in paths]

    def get(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(f"{self.root}/{name}"))

    def put(self, name: str, data: bytes | bytearray) -> None:
        if self._local:
            _put_local(self.root, name, data)
        else:
            self.fs.pipe_file(f"{self.root}/{name}", data)  # an object appears whole or not

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self.root}/{name}")


def _put_local(directory: str, name: str, data: bytes | bytearray) -> None:
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


# Protocols fsspec offers that name no place to keep checkpoints: read-only (http), gone with
# the process (memory), or views of other files (archives, caches). Any other fsspec store
# whose backend is installed (file, s3, gcs, ...) is accepted on the command line.
NOT_STORES = frozenset(
    {
        "http", "https", "memory", "data", "zip", "tar", "libarchive", "reference", "github",
        "git", "simplecache", "filecache", "blockcache", "cached", "dir",
    }
)  # fmt: skip
S3_PROTOCOLS = frozenset({"s3", "s3a"})


def check_url(flag: str, url: str, storage_options: Mapping[str, Any]) -> Location:
    """A checkpoint URL given as `flag` on a command line, checked without any I/O."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    if protocol in NOT_STORES:
        raise ConfigError(
            f"{flag} {url!r}: unsupported scheme {protocol!r}; checkpoints are kept in a "
            "filesystem or an object store: file:// (or a path), s3://, or another fsspec "
            "store whose backend is installed"
        )
    try:
        return Location.parse(url, storage_options)
    except ConfigError as error:
        raise ConfigError(f"{flag}: {error}") from None


def s3_credentials_found(options: Mapping[str, Any], env: Mapping[str, str], home: str) -> bool:
    """Whether an S3 client finds credentials without asking the network: in the storage
    options, AWS_* variables, a profile or a shared credentials/config file, a web identity
    token (EKS) or a container role (ECS). An EC2 instance role needs a network call:
    `instance_credentials_found`."""
    if options.get("anon") or (options.get("key") and options.get("secret")):
        return True
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    sources = (
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    )
    if any(env.get(name) for name in sources):
        return True
    files = (
        env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
        env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
    )
    return any(os.path.isfile(path) for path in files)


def instance_credentials_found(env: Mapping[str, str], timeout: float) -> bool:
    """Whether botocore's whole credential chain (an EC2 instance role included) finds any;
    botocore bounds its metadata calls (1 s each by default), `timeout` the whole search.
    With AWS_EC2_METADATA_DISABLED there is nothing left that `s3_credentials_found` missed."""
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true":
        return False

    def search() -> bool:
        import botocore.session  # type: ignore[import-untyped]  # (s3fs's) no stubs pinned

        return botocore.session.Session().get_credentials() is not None

    try:
        return bounded(search, timeout, "looking for S3 credentials")
    except Exception:  # an unreadable profile, no botocore: none found
        return False


def check_s3_access(
    flag: str,
    url: str,
    storage_options: Mapping[str, Any],
    env: Mapping[str, str],
    home: str,
    instance_role: Callable[[], bool],
) -> None:
    """Refuse an s3:// URL before anything starts when no credentials are to be found;
    the message says what to set (and the endpoint, for an S3-compatible store). Runs
    before `check_url`, which imports the S3 backend."""
    protocol = fsspec.core.split_protocol(url)[0]
    if protocol not in S3_PROTOCOLS:
        return
    if s3_credentials_found(storage_options, env, home) or instance_role():
        return
    endpoint = storage_options.get("client_kwargs", {}).get("endpoint_url")
    store = (
        f"the store at KEEPSTEP_S3_ENDPOINT={endpoint}"
        if endpoint
        else "AWS S3 (for an S3-compatible store such as MinIO, also set KEEPSTEP_S3_ENDPOINT)"
    )
    raise ConfigError(
        f"{flag} {url!r}: no S3 credentials found for {store}: set AWS_ACCESS_KEY_ID "
        "and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or write ~/.aws/credentials"
    )


def check_command_line_url(
    flag: str, url: str, storage_options: Mapping[str, Any], env: Mapping[str, str], home: str
) -> Location:
    """What `keepstep run` and `keepstep agent` check of a --checkpoint or --resume URL
    before anything starts: S3 credentials first (cheap, and before the S3 backend is
    imported), then the URL itself."""
    check_s3_access(
        flag, url, storage_options, env, home, lambda: instance_credentials_found(env, 5.0)
    )
    return check_url(flag, url, storage_options)
