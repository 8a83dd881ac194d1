"""Small models for the differential tests, built the same way on every rank from a seed."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


class MLPNet(nn.Module):
    """Input projection, residual blocks and a 3-row head (uneven at W=2 and W=4)."""

    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.norm(h)))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return cast(torch.Tensor, self.proj(y.transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return cast(torch.Tensor, x + self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A GPT-style decoder; ``tie=True`` shares the embedding with the head."""

    def __init__(
        self, vocab: int = 37, dim: int = 16, depth: int = 2, seq: int = 8, tie: bool = False
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, 2) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.tensor([1.0 + 0.5]), persistent=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.ln_f(h)) * self.scale)


def build(name: str, seed: int = 0) -> Any:
    """A fresh model with deterministic initial weights (typed Any: tests reach into it)."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLPNet()
    if name == "gpt":
        return TinyGPT()
    if name == "gpt_tied":
        return TinyGPT(tie=True)
    raise ValueError(f"unknown test model {name!r}")


def batch(name: str, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and targets, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        x = torch.randn(global_batch, 5, 7, generator=gen)
        y = torch.randn(global_batch, 5, 3, generator=gen)
        return x, y
    idx = torch.randint(0, 37, (global_batch, 9), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss for a model's output."""
    if name == "mlp":
        return F.mse_loss(out.float(), target)
    return F.cross_entropy(out.float().reshape(-1, out.size(-1)), target.reshape(-1))
