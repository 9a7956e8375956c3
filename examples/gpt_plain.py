"""A nanoGPT-style decoder trained in one process: the script examples/gpt.py ports.

A GPT (token and position embeddings, pre-norm blocks of causal self-attention and an MLP,
the output head tied to the token embedding) trained with AdamW (weight decay on the
matrices only), a linear warmup then cosine decay of the learning rate, gradient
clipping and bf16 autocast on the CPU. Each step accumulates the gradient of
global batch / micro batch micro-batches, each the mean loss of its sequences.

The text is synthetic and the same in every process: 32 words (fixed runs of 2 to 6 tokens
from a vocabulary of 64) drawn at random and separated by token 0, cut into sequences of
--block-size + 1 tokens. Within a word the next token is predictable; across words not.

    scripts/env python examples/gpt_plain.py --global-batch 32 --micro-batch 8 --steps 100

tests/launch/test_example_ports.py counts the lines gpt.py changes.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "heads must split the embedding evenly"
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying: one matrix in and out
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                # Residual projections scaled down by depth, as in GPT-2.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        # Decay the matrices (embeddings, linear weights), not the biases and norms.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def synthetic_text(block_size: int, sequences: int = 1024, vocab: int = 64) -> TensorDataset:
    """`sequences` (input, target) pairs of block_size tokens, targets shifted by one."""
    g = torch.Generator().manual_seed(4321)
    lengths = torch.randint(2, 7, (32,), generator=g).tolist()
    words = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    space = torch.zeros(1, dtype=torch.long)
    need, stream, size = sequences * (block_size + 1), [], 0
    while size < need:
        word = words[int(torch.randint(len(words), (1,), generator=g))]
        stream += [word, space]
        size += len(word) + 1
    rows = torch.cat(stream)[:need].view(sequences, block_size + 1)
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The LR factor at step i: linear warmup, then cosine down to a tenth."""

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        done = min(1.0, (i - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward pass")
    parser.add_argument("--steps", type=int, help="optimizer steps")
    parser.add_argument("--seed", type=int, help="the seed of the sequences drawn and dropout")
    parser.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate")
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear LR warmup")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    parser.set_defaults(global_batch=32, micro_batch=8, steps=100, seed=1)
    args = parser.parse_args()

    torch.manual_seed(1337)  # the initial weights
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=args.layers))
    optimizer = model.configure_optimizers(args.weight_decay, args.lr)
    dataset = synthetic_text(args.block_size)
    scheduler = LambdaLR(optimizer, warmup_cosine(args.warmup, args.steps))
    torch.manual_seed(args.seed)  # the sequences drawn and dropout
    model.train()
    for step in range(args.steps):
        for _ in range(args.global_batch // args.micro_batch):
            x, y = dataset[torch.randint(len(dataset), (args.micro_batch,))]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(x, y)
            assert loss is not None
            (loss * args.micro_batch / args.global_batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % args.log_every == 0:
            print(f"step {step} loss {loss:.4f} lr {scheduler.get_last_lr()[0]:.2e}")


if __name__ == "__main__":
    main()
