"""Tests of the NCCL transport's real path (keepstep.elastic.comm.nccl_group): they run only
where CUDA is present, and are skipped elsewhere; the CPU covers the rest in
test_transport_nccl.py."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from keepstep.elastic.comm.group import EpochSpec
from keepstep.elastic.comm.nccl import NcclTransport, OneLive
from keepstep.elastic.comm.nccl_group import build_group
from keepstep.elastic.comm.reap import Reaper

_CUDA0 = torch.device("cuda", 0)

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_cuda
def test_a_one_rank_nccl_group_reduces_aborts_and_is_rebuilt() -> None:
    slot = OneLive()
    transport = NcclTransport(_CUDA0, Reaper(), slot=slot, build=build_group)
    for epoch in (0, 1):
        spec = EpochSpec(epoch, ("a",), "a", timedelta(seconds=60), "127.0.0.1")
        link = transport.connect(HashStore(), spec)
        tensor = torch.full((4,), 3.0, device=_CUDA0)
        pending = link.allreduce(tensor, dist.ReduceOp.SUM, timedelta(seconds=60))
        for _ in range(60_000):
            if pending.ready(1):
                break
        pending.result()
        assert tensor.tolist() == [3.0] * 4
        link.retire(None)
        assert link.released.wait(60)
    assert slot.holder is None


@_cuda
def test_nccl2_constructs_in_a_fresh_process() -> None:
    code = (
        "import torch, torch.distributed as dist\n"
        "from torch._C._distributed_c10d import HashStore\n"
        "cls = getattr(dist, 'ProcessGroupNCCL2', None)\n"
        "if cls is None: print('absent'); raise SystemExit(0)\n"
        "opts = dist.ProcessGroupNCCL.Options(); opts.enable_reconfigure = True\n"
        "with torch.cuda.device(0): pg = cls(HashStore(), 0, 1, opts, None)\n"
        "print('built', pg.supports_reconfigure); pg.abort()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] in ("built", "absent")
