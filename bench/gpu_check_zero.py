"""gpu_check's ZeRO section: sharded optimizer state on the device, with the unsharded bits.

Where it sits: gpu_check_more.run calls `zero_on_device(section, device)`. Two parts:

  zero_threads_equal_unsharded, zero_state_on_device
      ZeroOptimizer (keepstep.elastic.zero) over W = 1, 2, 3 ranks on threads of this
      process, all on the device (the LocalGathers fake: one GPU holds every rank), for
      AdamW, fused AdamW and Muon beside AdamW, in float32 and (on CUDA) bfloat16: the
      parameters and the gathered state after 3 steps equal, bit for bit, the script's
      optimizer stepping the whole parameters on the same device; every rank's
      per-element state lives on the device.
  zero_job_equals_unsharded
      gpu_check_job's one-member job (keepstep.init on the device) with shard="zero1" and
      shard="zero2", each in a fresh process, ends with the params_sha256 of the same job
      unsharded: the epoch's communicator (NCCL on one rank), the shard's snapshot pieces
      copied from the device, and ZeRO-2's reduce-scatter and clipping on the device.

What one GPU cannot show (ZeRO over NCCL between GPUs) is in docs/gpu.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from keepstep.elastic.optimizer_group import OptimizerGroup
from keepstep.elastic.zero import LocalGathers, Ownership, ZeroOptimizer

SHAPES: list[tuple[int, ...]] = [(37, 5), (300,), (64, 48), (1,), (700, 3), (), (48, 64)]
MATRICES = [0, 2, 6]  # Muon's, in the "muon+adamw" case
STEPS = 3
TIMEOUT = timedelta(seconds=60)
PER_ELEMENT = frozenset({"exp_avg", "exp_avg_sq", "momentum_buffer"})


def zero_on_device(section: Any, device: str) -> None:
    """ZeRO's sharded step on the device: the unsharded bits, on threads and in a job"""
    where = torch.device(device)
    dtypes = [torch.float32, torch.bfloat16] if where.type == "cuda" else [torch.float32]
    cases, equal, on_device = [], True, True
    for kind in ("adamw", "adamw-fused", "muon+adamw"):
        for dtype in dtypes:
            want = _reference(kind, dtype, where)
            for world in (1, 2, 3):
                got = _sharded(kind, dtype, where, world)
                same = all((p, s) == want for p, s, _ in got)
                here = all(d == {where.type} for _, _, d in got)
                cases.append({"kind": kind, "dtype": str(dtype), "world": world, "equal": same})
                equal, on_device = equal and same, on_device and here
    section.details["threads"] = cases
    section.checks["zero_threads_equal_unsharded"] = equal
    section.checks["zero_state_on_device"] = on_device

    from gpu_check_job import FIRST_RUNS, child  # beside this file

    runs = {shard: child(device, shard) for shard in ("zero1", "zero2")}
    runs["none"] = FIRST_RUNS.get((device, "none")) or child(device)
    section.details["jobs"] = runs
    shas = {shard: run.get("params_sha256") for shard, run in runs.items()}
    section.checks["zero_job_equals_unsharded"] = (
        shas["none"] is not None and shas["zero1"] == shas["none"] == shas["zero2"]
    )


def _params(dtype: torch.dtype, device: torch.device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype).to(device)) for s in SHAPES]


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)
    rest = [p for i, p in enumerate(params) if i not in MATRICES]
    muon = torch.optim.Muon([params[i] for i in MATRICES], lr=0.02, momentum=0.9)
    return OptimizerGroup([muon, torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1)])


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The same reduced gradient on every rank; tensor 3 has none at step 0."""
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
        p.grad = None if (i == 3 and step == 0) else grad


def _reference(kind: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    params = _params(dtype, device)
    optimizer = _optimizer(kind, params)
    for step in range(STEPS):
        _set_grads(params, step)
        optimizer.step()
    return _params_sha(params), _state_sha(optimizer.state_dict())


def _sharded(
    kind: str, dtype: torch.dtype, device: torch.device, world: int
) -> list[tuple[str, str, set[str]]]:
    def member(rank: int, gather: Any) -> tuple[str, str, set[str]]:
        params = _params(dtype, device)
        ownership = Ownership.balanced([p.numel() for p in params], world)
        zero = ZeroOptimizer(params, _optimizer(kind, params), ownership, gather, timeout=TIMEOUT)
        for step in range(STEPS):
            _set_grads(params, step)
            zero.step()
        devices = {
            v.device.type
            for state in zero.inner.state.values()
            for k, v in state.items()
            if k in PER_ELEMENT and isinstance(v, torch.Tensor)
        }
        return _params_sha(params), _state_sha(zero.full_state_dict()), devices

    return LocalGathers(world, device).run(member, TIMEOUT * 2)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _params_sha(params: list[torch.nn.Parameter]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(_bytes(p))
    return h.hexdigest()


def _state_sha(state_dict: Mapping[str, Any]) -> str:
    """Every value's key, dtype, shape and bytes (not its device: torch keeps a step count
    on the CPU or the device by its own rules, the same for both sides)."""
    h = hashlib.sha256()
    for i, state in sorted(state_dict["state"].items()):
        for key, v in sorted(state.items()):
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            h.update(f"{i}/{key}/{t.dtype}/{tuple(t.shape)};".encode())
            h.update(_bytes(t))
    return h.hexdigest()
