"""A GPT-style decoder: the one definition that shardkit's tests, benchmarks and examples share.

The usual pre-norm decoder, kept small and plain: token and learned position embeddings,
blocks of (LayerNorm, causal self-attention, LayerNorm, GELU MLP), a final LayerNorm and an
output projection, optionally tied to the token embedding. Blocks live in ``blocks`` (an
``nn.ModuleList``), which is what the planner and the tests shard one by one.

The tests compare runs parameter by parameter, and the benchmarks compare step times with
earlier runs, so the modules are created in a fixed order: the same seed gives the same
parameters. Keep that order (and the attribute names, which are the state-dict keys) when
changing anything here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "CausalSelfAttention", "GPTBlock", "GPTConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Sizes of a GPT-style decoder."""

    vocab_size: int
    """Tokens in the vocabulary (embedding rows and output columns)."""
    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Attention heads; ``dim`` must divide by it."""
    max_seq_len: int
    """Longest sequence: rows of the position embedding."""
    tie_embeddings: bool = False
    """Whether the output projection shares its weight with the token embedding."""

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "dim": self.dim,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "max_seq_len": self.max_seq_len,
        }
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"GPTConfig: dim {self.dim} must divide by n_heads {self.n_heads}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused query/key/value projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` (B, T, dim)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)  # (B, T, H, D)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, D)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class GPTBlock(nn.Module):
    """Pre-norm residual block: attention, then a GELU MLP four times as wide."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block on the residual stream ``x`` (B, T, dim)."""
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A GPT-style decoder: logits (B, T, vocab) for token ids (B, T)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.max_seq_len, config.dim)
        self.blocks = nn.ModuleList(
            GPTBlock(config.dim, config.n_heads) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids ``idx`` (B, T)."""
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln_f(h))
        return logits
