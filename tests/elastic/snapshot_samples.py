"""Sample state for the snapshot tests: one of every kind of tensor a snapshot must hold."""

from __future__ import annotations

import torch


def sample_tensors(seed: int, n: int = 100) -> dict[str, torch.Tensor]:
    """Values fixed by ``seed``; a non-contiguous view, bfloat16, a 0-dim int64, bool,
    an empty tensor and complex64."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(n, 7, generator=g),
        "w_t": torch.randn(7, 5, generator=g).t(),  # not contiguous
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
        "count": torch.tensor(seed, dtype=torch.int64),  # 0-dim
        "mask": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "z": torch.randn(2, dtype=torch.complex64, generator=g),
    }
