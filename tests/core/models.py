"""Small models for the differential tests, built the same way on every rank from a seed."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.tools.plan.gpt import GPT, GPTConfig


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


class Tower(nn.Module):
    """A text projection, a tower only some batches use, and a head: a conditional module."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.text = nn.Linear(dim, dim)
        self.tower = Block(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor, use_tower: bool) -> torch.Tensor:
        h = self.text(x)
        if use_tower:
            h = h + self.tower(x)
        return cast(torch.Tensor, self.head(h))


class TinyGPT(GPT):
    """shardkit.tools' GPT, tiny, plus a persistent buffer (state dicts carry buffers too);
    ``tie=True`` shares the embedding with the head."""

    scale: torch.Tensor  # (1,), a buffer

    def __init__(
        self, vocab: int = 37, dim: int = 16, depth: int = 2, seq: int = 8, tie: bool = False
    ) -> None:
        config = GPTConfig(
            vocab_size=vocab,
            dim=dim,
            n_layers=depth,
            n_heads=2,
            max_seq_len=seq,
            tie_embeddings=tie,
        )
        super().__init__(config)
        self.register_buffer("scale", torch.tensor([1.0 + 0.5]), persistent=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.scale


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
