"""How many workers each node runs: `--nproc-per-node N|auto|gpu`, resolved without torch.

Where it sits: `keepstep run` parses the flag with `parse_nproc` and resolves it with
`resolve_nproc` before anything starts. The words mean what they mean to torchrun:
`gpu` is one worker per visible CUDA device (an error when there is none), `auto` is that
on a machine with CUDA devices and 1 without. Devices are counted by asking the CUDA driver
(`libcuda`, which applies CUDA_VISIBLE_DEVICES itself), because importing torch to count
them would take seconds and the launcher never needs torch otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
from collections.abc import Callable, Mapping

from keepstep.errors import ConfigError

WORDS = ("auto", "gpu")
_CUDA_SUCCESS = 0


def parse_nproc(text: str) -> int | str:
    """The flag's value: a count >= 1, or one of WORDS (resolved later)."""
    if text in WORDS:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of workers >= 1, auto or gpu")
    return value


def resolve_nproc(value: int | str, cuda_devices: Callable[[], int], env: Mapping[str, str]) -> int:
    """Workers per node for `value`; `cuda_devices` counts the visible CUDA devices."""
    if isinstance(value, int):
        return value
    count = cuda_devices()
    if value == "auto":
        return count or 1
    if value == "gpu" and count == 0:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        where = (
            f"CUDA_VISIBLE_DEVICES={visible!r}"
            if visible is not None
            else "no NVIDIA driver or device found"
        )
        raise ConfigError(
            f"--nproc-per-node gpu: no CUDA device is visible ({where}); give a number of "
            "workers, or auto (one worker on a machine without GPUs)"
        )
    if value == "gpu":
        return count
    raise ConfigError(f"--nproc-per-node {value!r}: must be a number >= 1, auto or gpu")


def visible_cuda_devices() -> int:
    """CUDA devices this process may use; 0 without an NVIDIA driver or device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != _CUDA_SUCCESS:
        return 0  # e.g. CUDA_ERROR_NO_DEVICE: a driver, but nothing visible
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_SUCCESS:
        return 0
    return int(count.value)
