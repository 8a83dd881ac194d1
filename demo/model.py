"""The demo's GPT: token + position embeddings, pre-LN blocks, a final LN, a linear head.

A plain single-device model that knows nothing of parallelism: demo/train_gpt.py applies
tensor parallelism (with `tensor_parallel_plan`, the split keyed by this model's module names)
and fully_shard to it from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "ModelConfig",
    "plan_inputs",
    "plan_model",
    "tensor_parallel_plan",
]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The GPT's shape. The defaults give about 1.3M parameters: a step takes about 0.25 s on
    two CPU cores."""

    vocab_size: int = 256
    """Bytes are the tokens, so 256 covers any UTF-8 text."""
    seq_len: int = 128
    """Context length in tokens; also the length of every training sequence."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 6
    """Number of transformer blocks; each becomes one fully_shard unit."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if min(self.vocab_size, self.seq_len, self.d_model, self.n_layers, self.n_heads) <= 0:
            raise ValueError(f"every size in {self} must be positive")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        # Separate projections, so that tensor parallelism can give each rank whole heads.
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        b, t = x.shape[:2]
        # Under TP each rank holds H/tp heads: its projections are D/tp wide (H' = local heads).
        q, k, v = (  # each (B, H', T, D/H)
            z.view(b, t, -1, self.head_dim).transpose(1, 2)
            for z in (self.q(x), self.k(x), self.v(x))
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H', T, D/H)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        out: Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, D)
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Not tied to tok_emb: both sit in the root's fully_shard unit either way, but untied
        # weights keep the state dict free of aliases.
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)
        # GPT-2's scaling: each residual branch adds to the stream once per block, so shrink its
        # output projection to keep the stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, idx: Tensor) -> Tensor:  # idx: (B, T) int64 → logits (B, T, V)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    """How tensor parallelism splits this model (for `parallelize_module` on a "tp" mesh).

    Megatron-style with sequence parallelism, as torchtitan applies it: attention heads and MLP
    columns split (colwise in, rowwise out); between them the activations split along the
    sequence (Shard(1)), so that the layer norms run on 1/tp of the tokens; the embedding
    tables split by rows, and the head gathers the full logits for the loss.
    """
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        gather_sequence = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan |= {
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn": gather_sequence,
            f"blocks.{i}.attn.q": ColwiseParallel(),
            f"blocks.{i}.attn.k": ColwiseParallel(),
            f"blocks.{i}.attn.v": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp": gather_sequence,
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def plan_model() -> GPT:
    """The default model on the meta device, for the planner (docs/multi-node.md):
    shardkit-plan demo.train_gpt:plan_model --inputs demo.train_gpt:plan_inputs ..."""
    with torch.device("meta"):
        return GPT(ModelConfig())


def plan_inputs(batch_size: int = 8) -> Tensor:
    """One rank's batch of token ids on the meta device, (batch_size, seq_len); 8 is
    demo/train_gpt.py's default --batch-size."""
    return torch.zeros(batch_size, ModelConfig().seq_len, dtype=torch.long, device="meta")
