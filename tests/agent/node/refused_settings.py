"""A training script whose settings keepstep refuses: it passes a global batch other than
the launcher's (test_worker_exits). No restart mends that, so the job must end at once."""

from __future__ import annotations

import runpy
from pathlib import Path

from torch import optim

import keepstep

mlp = runpy.run_path(str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py"))
model = mlp["make_model"]()
optimizer = optim.AdamW(model.parameters(), lr=3e-3)
keepstep.init(model, optimizer, mlp["make_dataset"](), global_batch=48, micro_batch=4)
