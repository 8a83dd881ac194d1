"""Model factories for the planner: Llama-style and GPT-style decoders, built on the meta device.

``shardkit-plan shardkit.tools.examples:llama_8b --world-size 64`` plans an 8B-parameter
configuration without allocating it: every factory here builds its model under
``torch.device("meta")``, so parameters have shapes and dtypes but no storage.

The GPT is :mod:`shardkit.tools.plan.gpt`, the model of shardkit's tests and benchmarks. The
Llama is the usual pre-norm decoder: token embedding, blocks of (RMSNorm, attention with
grouped-query heads and rotary positions, RMSNorm, SwiGLU MLP), a final RMSNorm and an untied
output projection. Blocks live in ``layers`` (an ``nn.ModuleList``), which is what the planner
shards one by one by default. :func:`llama_tp_plan` is torchtitan's tensor-parallel plan for
it (``--tp-plan shardkit.tools.examples:llama_tp_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from shardkit.tools.plan.gpt import GPT, GPTConfig

__all__ = [
    "Llama",
    "LlamaConfig",
    "gpt_35m",
    "gpt_35m_inputs",
    "gpt_demo",
    "gpt_demo_inputs",
    "gpt_small",
    "gpt_small_inputs",
    "llama_8b",
    "llama_8b_inputs",
    "llama_tiny",
    "llama_tiny_inputs",
    "llama_tp_plan",
    "one_dim_params_in_own_dtype",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Sizes of a Llama-style decoder."""

    dim: int = 4096
    """Width of the residual stream."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; ``dim`` must divide by it."""
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention); ``n_heads`` must divide by it."""
    ffn_dim: int = 14336
    """Hidden width of the SwiGLU MLP."""
    vocab_size: int = 128256
    """Tokens in the vocabulary (embedding rows and output columns)."""
    max_seq_len: int = 8192
    """Longest sequence the rotary tables cover."""
    rope_theta: float = 500000.0
    """Base of the rotary position frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"LlamaConfig: dim {self.dim} must divide by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: n_heads {self.n_heads} must divide by n_kv_heads {self.n_kv_heads}"
            )
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError("LlamaConfig: the head dim must be even (rotary pairs)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned scale, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of ``x``."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on (B, T, H, D): rotate pairs (even, odd) by the position angle."""
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, T, H, D/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary positions."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` (B, T, dim) with the rotary tables for its T positions."""
        b, t, _ = x.shape
        q = _rotate(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = _rotate(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # (B, H, T, head_dim)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(b, t, -1))
        return out


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to the last dim of ``x``."""
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One block on the residual stream ``x`` (B, T, dim)."""
        h = x + self.attention(self.attention_norm(x), cos, sin)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Llama(nn.Module):
    """A Llama-style decoder with an untied output projection."""

    rope_cos: torch.Tensor  # (max_seq_len, head_dim/2), a buffer
    rope_sin: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rotary_tables(config)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids (B, T)."""
        t = tokens.size(1)
        cos = self.rope_cos[:t, None, :]  # (T, 1, head_dim/2): broadcast over heads
        sin = self.rope_sin[:t, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


def _rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of position x frequency, (max_seq_len, head_dim/2) each."""
    half = config.head_dim // 2
    freqs = config.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def llama_8b() -> Llama:
    """An 8B-parameter Llama-3-style configuration on the meta device (about 8.03e9 params)."""
    with torch.device("meta"):
        return Llama(LlamaConfig())


def llama_8b_inputs(batch: int = 1, seq_len: int = 8192) -> torch.Tensor:
    """Meta token ids (batch, seq_len) for :func:`llama_8b`: one rank's micro-batch."""
    return _meta_token_ids(batch, seq_len)


def llama_tiny() -> Llama:
    """A small configuration (4 layers, dim 64) on the meta device, for quick plans."""
    config = LlamaConfig(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=1000, max_seq_len=256
    )
    with torch.device("meta"):
        return Llama(config)


def llama_tiny_inputs(batch: int = 2, seq_len: int = 128) -> torch.Tensor:
    """Meta token ids (batch, seq_len) for :func:`llama_tiny`."""
    return _meta_token_ids(batch, seq_len)


def llama_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Tensor and sequence parallelism for :class:`Llama`, as torchtitan applies it.

    Embedding rows and the MLP's and attention's inner projections are split over the tp axis
    (colwise in, rowwise out); norms run on sequence shards. The logits are gathered (no loss
    parallelism). A real run would also divide each block's head counts by the TP degree.
    """
    del model  # every Llama gets the same plan: the blocks are matched by pattern
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def gpt_small() -> GPT:
    """The benchmarks' GPT (8 blocks of width 256, about 8.45e6 params) on the meta device."""
    config = GPTConfig(vocab_size=4096, dim=256, n_layers=8, n_heads=4, max_seq_len=128)
    return _meta_gpt(config)


def gpt_small_inputs(batch: int = 4, seq_len: int = 128) -> torch.Tensor:
    """Meta token ids (batch, seq_len) for :func:`gpt_small`: one rank's micro-batch."""
    return _meta_token_ids(batch, seq_len)


def gpt_35m() -> GPT:
    """The "35M" GPT of the benchmarks (8 blocks of width 512, 8192 tokens: 33.7e6 params)."""
    config = GPTConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, max_seq_len=256)
    return _meta_gpt(config)


def gpt_35m_inputs(batch: int = 2, seq_len: int = 128) -> torch.Tensor:
    """Meta token ids (batch, seq_len) for :func:`gpt_35m`: a CPU rank's quick micro-batch."""
    return _meta_token_ids(batch, seq_len)


def gpt_demo() -> GPT:
    """The demo GPT's shape (6 blocks of width 128, 256 tokens: about 1.3e6 params)."""
    config = GPTConfig(vocab_size=256, dim=128, n_layers=6, n_heads=4, max_seq_len=128)
    return _meta_gpt(config)


def gpt_demo_inputs(batch: int = 8, seq_len: int = 128) -> torch.Tensor:
    """Meta token ids (batch, seq_len) for :func:`gpt_demo`: the demo's 8 sequences a rank."""
    return _meta_token_ids(batch, seq_len)


def _meta_gpt(config: GPTConfig) -> GPT:
    """A GPT of ``config`` on the meta device: shapes and dtypes, no storage."""
    with torch.device("meta"):
        return GPT(config)


def _meta_token_ids(batch: int, seq_len: int) -> torch.Tensor:
    """Token ids (batch, seq_len) on the meta device: every factory's inputs."""
    return torch.empty(batch, seq_len, dtype=torch.long, device="meta")


def one_dim_params_in_own_dtype(param: nn.Parameter) -> torch.dtype | None:
    """A ``param_dtype_override_fn``: 1-D parameters (norm scales, biases) in their own dtype.

    The rest are gathered in ``param_dtype``. It decides from the parameter's shape, so the
    meta model the planner builds gets the same answers as the model the engine shards.
    """
    return param.dtype if param.ndim == 1 else None
