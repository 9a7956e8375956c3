"""`keepstep.device()`: the device this worker trains on.

Where it sits: called by the training script before it moves its model, like torchrun's
``LOCAL_RANK`` recipe. The node agent starts one worker per local slot and gives each
``LOCAL_RANK`` (its slot, 0..nproc-1) and ``LOCAL_WORLD_SIZE``; with
``--nproc-per-node gpu`` that is one worker per visible GPU, and worker ``LOCAL_RANK``
trains on GPU ``LOCAL_RANK``. The job then builds each epoch's communicator for the
parameters' device (NCCL for CUDA, gloo for the CPU).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from keepstep.elastic.errors import ConfigError
from keepstep.elastic.rng import CUBLAS_WORKSPACE_CONFIG

__all__ = ["device"]


def device(env: Mapping[str, str] | None = None) -> torch.device:
    """GPU ``LOCAL_RANK`` (made the current CUDA device) when CUDA is available, else the
    CPU. ``LOCAL_RANK`` defaults to 0 (a script run on its own); a value that names no
    visible GPU is refused, naming the count this process sees.

    It also sets ``CUBLAS_WORKSPACE_CONFIG`` in the process environment when it is unset
    and CUDA has not started: cuBLAS reads it once, and a script run on its own that moves
    its model to the GPU before `keepstep.init` would otherwise start cuBLAS with a
    nondeterministic workspace (which init then refuses)."""
    env = os.environ if env is None else env
    raw = env.get("LOCAL_RANK", "0")
    try:
        local = int(raw)
    except ValueError:
        local = -1
    if local < 0:
        raise ConfigError(f"LOCAL_RANK={raw!r} must be an int >= 0 (the worker's local slot)")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    count = torch.cuda.device_count()
    if local >= count:
        raise ConfigError(
            f"LOCAL_RANK={local} but this process sees {count} CUDA device(s) "
            f"(0..{count - 1}); run one worker per GPU (--nproc-per-node gpu)"
        )
    torch.cuda.set_device(local)
    return torch.device("cuda", local)
