"""A small decoder-only transformer with dropout, trained elastically on synthetic text.

Sizes are flags, so the same script is the benchmark workload (`--d-model 384 --layers 6
--seq 1024` is ~11M parameters with 1k tokens per sample):
    scripts/env python examples/transformer.py --global-batch 32 --micro-batch 4 --steps 20
`--muon` steps the blocks' matrices with Muon and the rest with AdamW.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import keepstep


class CopyTask(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token sequences made of repeated random motifs: learnable, fixed by a seed."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(4321)
        motifs = torch.randint(0, vocab, (n, 8), generator=g)
        reps = math.ceil((seq + 1) / 8)
        self.tokens = motifs.repeat(1, reps)[:, : seq + 1]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[i]
        return row[:-1], row[1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)
        self.heads = heads
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads, 0.1) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--save", help="write the final state dict here (from one member)")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model (Inductor); same numbers"
    )
    parser.add_argument(
        "--muon",
        action="store_true",
        help="Muon for the blocks' matrices, AdamW for embeddings, norms, biases and head",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model: nn.Module = TinyGPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    if args.compile:
        # Every micro-batch has the same shapes, so it compiles once; its dropout draws its
        # seeds from the generator the job keys per micro-batch.
        model = torch.compile(model)
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer]
    if args.muon:  # as large models are trained; it shards too (keepstep run --shard zero1)
        hidden = [p for n, p in model.named_parameters() if "blocks." in n and p.ndim == 2]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        optimizer = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = CopyTask(4096, args.seq, args.vocab)
    job = keepstep.init(model, optimizer, data, args.global_batch, args.micro_batch, args.seed)
    for step in job.steps(args.steps):
        losses = []
        for mb in step.micro_batches():
            logits = model(mb.inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten())
            step.backward(loss)
            losses.append(loss.item())
        step.commit()
        if job.is_leader and step.index % 10 == 0:
            print(f"step {step.index} loss {sum(losses) / max(len(losses), 1):.4f}", flush=True)
    if job.is_leader:
        print(f"done steps={job.done} params_sha256={job.params_sha256()}", flush=True)
        if args.save:
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
