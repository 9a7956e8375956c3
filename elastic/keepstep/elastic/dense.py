"""Sparse gradients are refused by name: the exact reduction sums dense ones.

Where it sits: the Job checks the model's modules at construction (``check_modules``) and
each micro-batch's gradients after its backward (``check_grads``, for a sparse gradient
that no module declared, from ``F.embedding(..., sparse=True)``). Before, a sparse
embedding gradient failed deep in the reducer with torch's "unsupported memory format".

Why not densify it: the sum is dense anyway (every element of the table is summed across
members), so a sparse layout saves nothing on the wire; and an optimizer for sparse
gradients (SparseAdam, sparse Adagrad) updates only the rows a step touched, which a
dense sum cannot tell from rows whose gradients summed to zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from keepstep.elastic.errors import ConfigError

__all__ = ["check_grads", "check_modules"]

_ADVICE = (
    "the exact reduction sums dense gradients only. Build it with sparse=False (the "
    "summed gradient is dense anyway), and step it with a dense optimizer (Adam, not "
    "SparseAdam)"
)


def check_modules(model: torch.nn.Module) -> None:
    """``ConfigError`` naming the first trainable embedding built with ``sparse=True``."""
    for name, module in model.named_modules():
        sparse = isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
        if sparse and module.weight.requires_grad:
            kind = type(module).__name__
            raise ConfigError(f"{kind} {name or '(the model)'!r} has sparse=True: {_ADVICE}")


def check_grads(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
    """``ConfigError`` naming the first of ``params`` whose ``.grad`` is not dense."""
    for p in params:
        if p.grad is not None and p.grad.layout is not torch.strided:
            name = next((n for n, q in model.named_parameters() if q is p), "?")
            raise ConfigError(
                f"parameter {name!r} has a {p.grad.layout} gradient (an embedding looked up "
                f"with sparse=True?): {_ADVICE}"
            )
