"""The job test_weights.py launches: next-token prediction on padded sequences of varying
length, the loss summed over the tokens that count and divided by their global count
(``weighted_mean=True``); prints its final hashes and the step's total weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import keepstep

VOCAB, LENGTH, IGNORE = 24, 12, -100


def padded_tokens(n: int, seed: int) -> TensorDataset:
    """``n`` sequences of 2..LENGTH tokens, padded; targets are the next token, IGNORE at
    padding, so a micro-batch counts anywhere from a few to many tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, LENGTH + 1), generator=g)
    lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
    keep = torch.arange(LENGTH + 1) < lengths[:, None]
    tokens = torch.where(keep, tokens, 0)
    targets = torch.where(keep[:, 1:], tokens[:, 1:], IGNORE)
    return TensorDataset(tokens[:, :-1], targets)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.mix(self.embed(tokens)))))


def loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def main() -> None:
    data = padded_tokens(384, seed=7)
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = keepstep.init(
        model, optimizer, data, weighted_mean=True, clip_grad_norm=1.0, metrics=("loss",)
    )
    losses = []
    for step in job.steps():
        for mb in step.micro_batches():
            inputs, targets = mb.inputs, mb.targets
            count = (targets != IGNORE).sum()
            loss = loss_sum(model, inputs, targets)
            step.log(loss=loss / count)  # weighted by count at commit: the token mean
            step.backward(loss, weight=count)
        if result := step.commit():
            losses.append(result.metrics["loss"])
    print(f"losses={[float.hex(v) for v in losses]}")
    print(f"done steps={job.done} params_sha256={job.params_sha256()}")


if __name__ == "__main__":
    main()
