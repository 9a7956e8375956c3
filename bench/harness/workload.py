"""The training side of the workload, shared by every job script (this module imports torch).

The same model (examples/transformer.py's TinyGPT, dropout 0.1, seeded init), data
(its CopyTask), optimizer (AdamW, lr 1e-3) and sample keying for all four systems:
micro-batch `mb` of data step `s` reads `SampleOrder(seed, ...).indices(s, mb)` and runs
its forward and backward under `rng_scope(seed, s, mb)`, the way keepstep does, so in a
fault-free run every system computes the same mean over the same samples and dropout
masks, and the ledger can name each sample by (seed, step, micro-batch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.config import Workload
from keepstep.elastic.rng import SampleOrder, fix_determinism

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from transformer import CopyTask, TinyGPT

DATASET_LEN = 4096
LR = 1e-3


def setup_process() -> None:
    """One thread and deterministic kernels, in every system's processes alike."""
    fix_determinism(1)


def build(w: Workload) -> tuple[nn.Module, torch.optim.Optimizer, CopyTask]:
    torch.manual_seed(0)  # identical initial parameters in every process of every system
    model = TinyGPT(w.vocab, w.seq, w.d_model, w.layers, w.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, optimizer, CopyTask(DATASET_LEN, w.seq, w.vocab)


def sample_order(w: Workload) -> SampleOrder:
    return SampleOrder(w.seed, DATASET_LEN, w.micro_batch, w.n_micro)


def batch(
    data: CopyTask, order: SampleOrder, key_step: int, mb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [data[i] for i in order.indices(key_step, mb)]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def save_params(model: nn.Module, path: str | Path) -> None:
    """The final parameters, for the deviation check (written to a temp name, then renamed)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp)
    tmp.replace(target)
