"""How long torch's NCCL group takes to abort on one GPU, under the environment keepstep
sets for its epochs (comm/nccl_policy.ENV_FOR_ABORT) and variants of it: each in a fresh
process, since torch reads these variables when a group is built.

    python3 bench/nccl_abort.py          # on a CUDA machine; prints one JSON object
                                         # (exit 1 if a variant failed: its stderr's end)

Per variant: the group's build and eager connect, a first allreduce, and ``abort()``
(seconds), on a one-rank legacy ProcessGroupNCCL (or NCCL2 where torch has it is not
covered: keepstep's own check, bench/gpu_check.py, times that path). An abort is on the
path of every recovery with NCCL (one live communicator per process), so its seconds add
to the MTTR of a GPU job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "elastic"))

from keepstep.elastic.comm.nccl_policy import ENV_FOR_ABORT  # noqa: E402

VARIANTS: dict[str, dict[str, str]] = {
    "keepstep": dict(ENV_FOR_ABORT),
    "blocking_comm": {**ENV_FOR_ABORT, "TORCH_NCCL_USE_COMM_NONBLOCKING": "0"},
    "monitoring_on": {**ENV_FOR_ABORT, "TORCH_NCCL_ENABLE_MONITORING": "1"},
    # The monitor thread wakes every TORCH_NCCL_COORD_CHECK_MILSEC (1000 by default): if
    # abort() joins it, a shorter interval is a shorter abort (first GPU run: ~1.0 s).
    "coord_check_10ms": {**ENV_FOR_ABORT, "TORCH_NCCL_COORD_CHECK_MILSEC": "10"},
    "torch_defaults": {},
}


def child() -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t0 = time.perf_counter()
    opts = dist.ProcessGroupNCCL.Options()
    group: Any = dist.ProcessGroupNCCL(HashStore(), 0, 1, opts)
    try:
        group.bound_device_id = device
    except AttributeError:
        pass
    group.eager_connect_single_device(device)
    t1 = time.perf_counter()
    x = torch.ones(1 << 20, device=device)
    group.allreduce([x]).wait()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    group.abort()
    t3 = time.perf_counter()
    return {"build_s": t1 - t0, "first_allreduce_s": t2 - t1, "abort_s": t3 - t2}


def main() -> int:
    if "--child" in sys.argv:
        print(json.dumps(child()))
        return 0
    out: dict[str, object] = {}
    for name, env in VARIANTS.items():
        environ = {k: v for k, v in os.environ.items() if k not in ENV_FOR_ABORT} | env
        done = subprocess.run(
            [sys.executable, __file__, "--child"],
            env=environ, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        out[name] = json.loads(lines[-1]) if done.returncode == 0 and lines else done.stderr[-800:]
    print(json.dumps(out, indent=1))
    return 1 if any(isinstance(v, str) for v in out.values()) else 0  # a variant failed


if __name__ == "__main__":
    sys.exit(main())
