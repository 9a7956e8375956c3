"""A training script whose workers die of SIGABRT after their finish was recorded, as a
worker did when a c10d store call failed while its interpreter shut down
(test_worker_exits). Each member trains examples/mlp.py's model to the end first.
"""

from __future__ import annotations

import os
import runpy
import signal
from pathlib import Path

import torch.nn.functional as F
from torch import optim

import keepstep

mlp = runpy.run_path(str(Path(__file__).resolve().parents[3] / "examples" / "mlp.py"))
model = mlp["make_model"]()
job = keepstep.init(model, optim.AdamW(model.parameters(), lr=3e-3), mlp["make_dataset"]())
for step in job.steps():
    for mb in step.micro_batches():
        step.backward(F.mse_loss(model(mb.inputs), mb.targets))
    step.commit()
if not job.left:
    os.kill(os.getpid(), signal.SIGABRT)
