"""Building one epoch's NCCL group with torch's public API: the part that needs a GPU.

Where it sits: called by `NcclTransport.connect` (nccl.py) on the build thread of
group.py, once the slot for the process's one live communicator is taken. It observes the
torch build and the environment, applies what nccl_policy.py decides, and connects:

- NCCL2 (``ProcessGroupNCCL2``, torch >= 2.15): built in the reconfigure regime
  (``enable_reconfigure``), where ``abort()`` revokes work in flight instead of killing the
  process; the members exchange their reconfigure handles through the epoch's store and
  ``reconfigure`` connects them (uuid: the epoch).
- legacy (``ProcessGroupNCCL``; torch without NCCL2, or ``TORCH_DIST_USE_NCCL2=0``):
  non-blocking communicators (``config.blocking = 0`` and the environment), bound to the
  device and connected eagerly, so a member that never comes fails the build, not the
  first step.

torch reads its NCCL settings (watchdog, monitor, blocking) from the environment when a
group is built, so ``build_group`` sets the few of ``ENV_FOR_ABORT`` that differ. Without
a GPU it raises at once; the CPU tests cover the options and the handle exchange.
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# The typed names live here; torch.distributed re-exports them only at runtime.
# (ReconfigureOptions exists only with NCCL2, torch >= 2.15: imported where it is used.)
from torch._C._distributed_c10d import Store

from keepstep.elastic.comm.group import EpochSpec, own_prefix
from keepstep.elastic.comm.nccl_policy import (
    Flavour,
    NcclSettings,
    OptionsPlan,
    choose_flavour,
    env_changes,
    plan_options,
)

_CONNECT_POLL_S = 0.001


def observed_flavour(env: MutableMapping[str, str]) -> tuple[Flavour, str]:
    """The NCCL group this torch build offers (see `choose_flavour`)."""
    has_nccl2 = getattr(dist, "ProcessGroupNCCL2", None) is not None
    return choose_flavour(has_nccl2, dist.is_nccl_available(), env)


def build_group(
    store: Store,
    spec: EpochSpec,
    device: torch.device,
    settings: NcclSettings,
    env: MutableMapping[str, str] | None = None,
) -> Any:
    """Build and connect epoch ``spec.epoch``'s NCCL group on ``device``; RuntimeError if
    it cannot (no GPU, a member missing past the spec's timeout)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the NCCL transport needs a CUDA device; this process sees none")
    environ = os.environ if env is None else env
    flavour, _why = observed_flavour(environ)
    environ.update(env_changes(environ))
    plan = plan_options(flavour, spec.timeout, settings)
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=plan.high_priority_stream)
    apply_options(opts, plan)
    prefixed = own_prefix(store, spec.epoch)
    if flavour is Flavour.NCCL2:
        return _reconfigured(prefixed, spec, device, opts)
    return _legacy(prefixed, spec, device, opts)


def apply_options(opts: Any, plan: OptionsPlan) -> None:
    """Write ``plan`` into a ``ProcessGroupNCCL.Options`` (fields torch lacks are skipped:
    the environment then carries the non-blocking setting)."""
    opts._timeout = plan.timeout
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = plan.blocking
    if plan.enable_reconfigure:
        opts.enable_reconfigure = True


def exchange_handles(store: Store, spec: EpochSpec, mine: str) -> list[str]:
    """Every member's reconfigure handle in rank order, through the epoch's store; waits
    up to the spec's timeout for all of them."""
    keys = [f"nccl-handle/{rank}" for rank in range(spec.size)]
    store.set(keys[spec.rank], mine)
    store.wait(keys, spec.timeout)
    return [store.get(key).decode() for key in keys]


def _legacy(store: Store, spec: EpochSpec, device: torch.device, opts: Any) -> Any:
    group: Any = dist.ProcessGroupNCCL(store, spec.rank, spec.size, opts)
    try:
        try:
            group.bound_device_id = device
        except AttributeError:
            pass  # an older torch: eager_connect names the device itself
        group.eager_connect_single_device(device)
    except BaseException:
        group.abort()
        raise
    return group


def _reconfigured(store: Store, spec: EpochSpec, device: torch.device, opts: Any) -> Any:
    from torch._C._distributed_c10d import ReconfigureOptions

    nccl2 = dist.ProcessGroupNCCL2
    with torch.cuda.device(device):
        # In the reconfigure regime torch itself passes no device: the current one is used.
        group = nccl2(store, spec.rank, spec.size, opts, None)
    try:
        if not group.supports_reconfigure:
            raise RuntimeError("this ProcessGroupNCCL2 does not support reconfigure")
        handles = exchange_handles(store, spec, group.get_reconfigure_handle())
        ropts = ReconfigureOptions()
        ropts.uuid = spec.epoch
        ropts.handles = handles
        ropts.timeout = spec.timeout
        with torch.cuda.device(device):
            work = group.reconfigure(ropts)
        _wait_connected(work, spec.timeout)
    except BaseException:
        group.abort()
        raise
    return group


def _wait_connected(work: Any, timeout: timedelta) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"NCCL reconfigure did not finish within {timeout}")
        time.sleep(_CONNECT_POLL_S)
    work.wait()  # raises if connecting failed
