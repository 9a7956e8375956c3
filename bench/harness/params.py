"""Parameter deviation between two runs' final parameters (the only figure that loads torch).

Each job saves its final `state_dict` with torch.save; the deviation is the largest
absolute difference over every tensor, 0.0 exactly when the two are bit-for-bit equal
(and compared as float64, so no difference is rounded away).
"""

from __future__ import annotations

from pathlib import Path


def max_abs_diff(a: Path, b: Path) -> float:
    import torch

    left = torch.load(a, weights_only=True)
    right = torch.load(b, weights_only=True)
    if left.keys() != right.keys():
        raise ValueError(f"{a} and {b} hold different parameters")
    worst = 0.0
    for key, x in left.items():
        y = right[key]
        if x.shape != y.shape:
            raise ValueError(f"{key}: shape {tuple(x.shape)} != {tuple(y.shape)}")
        diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        worst = max(worst, float(diff))
    return worst
