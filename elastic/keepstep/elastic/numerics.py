"""The numerics fingerprint: what, besides the inputs, decides the bits a member computes.

Where it sits: exact mode promises that a step's numbers do not depend on who computed
which micro-batch. That holds between members whose kernels round the same way: the same
GPU model and SM count (cuBLAS picks its algorithm, and so its summation order, by them),
driver, CUDA, cuBLAS and cuDNN versions, and torch version; on the CPU, the processor
model, the instruction set torch dispatches to, and torch. And the model's kernels:
`torch.compile` fuses ops into kernels that round differently from eager ones, so a
member compiled and a member eager part bits (`model_kernels` tells them apart: a script
that compiles only where some condition holds). `current()` reads them for this
process; `mixed_reason` and `check_agreement` are the pure decision over every member's
fingerprint, and `agree` runs it as every epoch is entered, before its first step (the
fingerprint rides in each member's view as `as_dict()`: transfer.exchange_views).

Nothing here initialises CUDA: `current(torch.device("cuda"))` does, by asking the device.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import logging
import platform
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from keepstep.elastic.errors import BadMessage, ConfigError, KeepstepError
from keepstep.elastic.reduce_base import ReduceMode

__all__ = [
    "NumericsFingerprint",
    "NumericsMismatch",
    "agree",
    "check_agreement",
    "current",
    "mixed_reason",
    "model_kernels",
]

UNKNOWN = "unknown"
log = logging.getLogger(__name__)


class NumericsMismatch(KeepstepError):
    """Members with different numerics fingerprints were asked to run in exact mode."""


@dataclass(frozen=True)
class NumericsFingerprint:
    """Everything that decides a member's kernel bits besides its inputs. Strings so that a
    record written by one version of keepstep reads back in another; `UNKNOWN` where this
    process cannot tell (two unknowns count as equal: they may differ, which is said)."""

    device_kind: str  # "cuda" or "cpu"
    device_name: str  # the GPU model, or the CPU model
    capability: str  # CUDA compute capability "9.0"; the CPU's instruction set ("AVX512")
    sm_count: int  # streaming multiprocessors; 0 on the CPU
    driver: str
    cuda: str
    cublas: str
    cudnn: str
    torch: str
    kernels: str = "eager"  # or what of the model torch.compile compiles (model_kernels)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sm_count":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ConfigError(f"sm_count={value!r} must be an int >= 0")
            elif not isinstance(value, str) or not value:
                raise ConfigError(f"{f.name}={value!r} must be a non-empty str ({UNKNOWN!r})")
        if self.device_kind not in ("cuda", "cpu"):
            raise ConfigError(f"device_kind={self.device_kind!r}; allowed: 'cuda', 'cpu'")

    @property
    def digest(self) -> str:
        """16 hex digits of blake2b over the canonical JSON: equal iff all fields are."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def as_dict(self) -> dict[str, str | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> NumericsFingerprint:
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ConfigError(f"fingerprint keys {sorted(data)}; expected {sorted(names)}")
        return cls(**data)  # type: ignore[arg-type]  # each field is checked by __post_init__

    def describe(self) -> str:
        """One line for error messages and logs."""
        if self.device_kind == "cpu":
            line = f"cpu {self.device_name} ({self.capability}), torch {self.torch}"
        else:
            line = (
                f"{self.device_name} (sm {self.capability}, {self.sm_count} SMs), driver "
                f"{self.driver}, CUDA {self.cuda}, cuBLAS {self.cublas}, cuDNN {self.cudnn}, "
                f"torch {self.torch}"
            )
        return f"{line}, {self.kernels} model"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or UNKNOWN
    except OSError:
        pass
    return platform.processor() or platform.machine() or UNKNOWN


def _driver_version() -> str:
    """The CUDA driver's version as "major.minor", from libcuda itself (torch has no API)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        out = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(out)) != 0:
            return UNKNOWN
    except (OSError, AttributeError):
        return UNKNOWN
    return f"{out.value // 1000}.{out.value % 1000 // 10}"


def _dist_version(prefix: str) -> str:
    """The version of the installed wheel whose name starts with `prefix` (nvidia-cublas,
    nvidia-cublas-cu12, ...): the library torch loads, where torch has no API for it."""
    found = sorted(
        (d.metadata["Name"] or "", d.version)
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(prefix)
    )
    return found[0][1] if found else UNKNOWN


def model_kernels(model: torch.nn.Module) -> str:
    """What of ``model`` runs compiled: ``"eager"``, ``"compiled"`` (``torch.compile(model)``
    or ``model.compile()``), or ``"compiled in part (N of M modules)"`` (submodules compiled
    in place). A function compiled apart from the model is not seen."""
    # Only dynamo makes these wrappers: not imported, nothing is compiled (and importing it
    # here would cost a second).
    frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(frame, "OptimizedModule", None)
    if wrapper is not None and isinstance(model, wrapper):
        return "compiled"
    modules = list(model.modules())
    compiled = [
        m
        for m in modules
        if getattr(m, "_compiled_call_impl", None) is not None
        or (wrapper is not None and isinstance(m, wrapper))
    ]
    if not compiled:
        return "eager"
    if compiled[0] is model:
        return "compiled"
    return f"compiled in part ({len(compiled)} of {len(modules)} modules)"


def current(device: torch.device | None = None, kernels: str = "eager") -> NumericsFingerprint:
    """This process's fingerprint for `device` (default: the current CUDA device when
    CUDA is available, else the CPU) and a model whose kernels are ``kernels``
    (``model_kernels``)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    version = torch.__version__
    if device.type == "cpu":
        return NumericsFingerprint(
            device_kind="cpu",
            device_name=_cpu_model(),
            capability=torch.backends.cpu.get_cpu_capability() or UNKNOWN,
            sm_count=0,
            driver=UNKNOWN,
            cuda=UNKNOWN,
            cublas=UNKNOWN,
            cudnn=UNKNOWN,
            torch=version,
            kernels=kernels,
        )
    if device.type != "cuda":
        raise ConfigError(f"device={device}; a fingerprint is read for 'cuda' or 'cpu'")
    props = torch.cuda.get_device_properties(device)
    cudnn_lib: Any = torch.backends.cudnn  # its functions are untyped
    cudnn = cudnn_lib.version() if cudnn_lib.is_available() else None
    return NumericsFingerprint(
        device_kind="cuda",
        device_name=props.name,
        capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        driver=_driver_version(),
        cuda=torch.version.cuda or UNKNOWN,
        cublas=_dist_version("nvidia-cublas"),
        cudnn=str(cudnn) if cudnn else UNKNOWN,
        torch=version,
        kernels=kernels,
    )


def mixed_reason(fingerprints: Mapping[str, NumericsFingerprint]) -> str | None:
    """None when every member has the same fingerprint; else a reason naming two members
    that differ, both fingerprints and the fields that differ. Pure."""
    if not fingerprints:
        return None
    members = sorted(fingerprints)
    first = members[0]
    base = fingerprints[first]
    for other in members[1:]:
        fp = fingerprints[other]
        if fp != base:
            diff = [f.name for f in fields(base) if getattr(base, f.name) != getattr(fp, f.name)]
            groups = len({f.digest for f in fingerprints.values()})
            return (
                f"members differ in numerics ({groups} fingerprints; {', '.join(diff)}): "
                f"{first} has {base.describe()} [{base.digest}], {other} has "
                f"{fp.describe()} [{fp.digest}]"
            )
    return None


def check_agreement(
    fingerprints: Mapping[str, NumericsFingerprint], mode: ReduceMode
) -> str | None:
    """Raise NumericsMismatch (naming both fingerprints) if members differ in EXACT mode;
    in FAST mode return the reason (to log: its deviation is measured, not promised)."""
    reason = mixed_reason(fingerprints)
    if reason is not None and ReduceMode(mode) is ReduceMode.EXACT:
        raise NumericsMismatch(
            f"exact mode needs one numerics fingerprint across members: {reason}; "
            "give the job identical nodes, or use reduce mode 'fast'"
        )
    return reason


def agree(told: Mapping[str, Mapping[str, object] | None], mode: ReduceMode) -> str | None:
    """The epoch's check, run by every member on the fingerprints its members told as
    ``as_dict()`` (by member; None: a member that told none, left out). BadMessage names a
    member whose fingerprint is malformed; then as ``check_agreement``."""
    fingerprints = {}
    for member, data in told.items():
        if data is None:
            continue
        try:
            fingerprints[member] = NumericsFingerprint.from_dict(data)
        except (ConfigError, TypeError) as error:
            raise BadMessage(f"{member}'s numerics fingerprint: {error}") from None
    reason = check_agreement(fingerprints, mode)
    if reason is not None:  # fast mode: its deviation is measured, not promised
        log.warning("%s", reason)
    return reason
