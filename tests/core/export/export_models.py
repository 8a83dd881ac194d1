"""Models and training for the export tests: a small Qwen2-style decoder, sharded by
shardkit's or torch's ``fully_shard``, trained a step at a time with AdamW."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class Layer(nn.Module):
    """Attention-shaped projections and a gated MLP: names as Hugging Face's Qwen2 layers."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {
                n: nn.Linear(dim, dim, bias=n != "o_proj")
                for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            }
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(dim, hidden, bias=False),
                "up_proj": nn.Linear(dim, hidden, bias=False),
                "down_proj": nn.Linear(hidden, dim, bias=False),
            }
        )
        self.input_layernorm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        a: Any = self.self_attn
        x = x + a["o_proj"](a["q_proj"](h) * torch.sigmoid(a["k_proj"](h)) + a["v_proj"](h))
        m: Any = self.mlp
        out: torch.Tensor = m["down_proj"](nn.functional.silu(m["gate_proj"](x)) * m["up_proj"](x))
        return x + out


class Decoder(nn.Module):
    """Embedding, layers, a norm with a persistent buffer, and an LM head tied to the embedding."""

    def __init__(self, vocab: int = 61, dim: int = 24, hidden: int = 40, layers: int = 3) -> None:
        super().__init__()
        self.model: Any = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList(Layer(dim, hidden) for _ in range(layers))
        self.model.norm = nn.LayerNorm(dim)
        self.model.register_buffer("position_scale", torch.linspace(0.5, 1.5, dim))
        self.model.register_buffer("rotary", torch.ones(dim), persistent=False)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens) * self.model.position_scale
        for layer in self.model.layers:
            x = layer(x)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


def fully_shard_of(impl: str) -> Any:
    """``fully_shard`` of ``"torch"`` or ``"shardkit"``."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    from shardkit.core import fully_shard as shardkit_fully_shard

    return shardkit_fully_shard


def parallelize_decoder(model: Decoder, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP on ``tp_mesh``: q, k, v, gate and up column-wise, o and down row-wise."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in model.model.layers:
        plan: dict[str, ParallelStyle] = {
            f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")
        }
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        plan |= {f"mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
        parallelize_module(layer, tp_mesh, plan)


def sharded(impl: str, mesh: DeviceMesh | None = None, seed: int = 0, **kw: Any) -> Decoder:
    """A :class:`Decoder` sharded layer by layer with ``impl``'s ``fully_shard``."""
    fully_shard = fully_shard_of(impl)
    torch.manual_seed(seed)
    model = Decoder(**kw)
    mesh = mesh or init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> float:
    """One AdamW step on a batch of this rank's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 61, (2, 5), generator=g)
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def full_state(
    model: nn.Module, dtype: torch.dtype, *, keep_tp: bool = False
) -> dict[str, torch.Tensor]:
    """The oracle: every exported tensor's ``full_tensor().to(dtype)`` (tied once, buffers
    persistent only), by name; with ``keep_tp``, each rank's TP part of tensors on a mesh with
    a ``tp`` axis, through DTensor's own redistribute."""
    from torch.distributed.tensor import DTensor, Replicate

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, DTensor):
            if keep_tp and "tp" in (value.device_mesh.mesh_dim_names or ()):
                placements = [Replicate()] * (value.device_mesh.ndim - 1) + [value.placements[-1]]
                full = value.redistribute(placements=placements).to_local()
            else:
                full = value.full_tensor()
        else:
            full = value.detach()
        out[key] = full.to(dtype) if full.is_floating_point() else full.clone()
    return out


def perturb(model: torch.nn.Module, sync: int) -> None:
    """Change every shard a little, differently per rank and sync (as an optimizer would)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            local = p.to_local() if isinstance(p, DTensor) else p
            # Seeded by the coordinates along the axes that cut it: replicas stay equal.
            where = 0
            if isinstance(p, DTensor):
                coord = list(p.device_mesh.get_coordinate() or [])
                for c, placement in zip(coord, p.placements, strict=True):
                    where = where * 8 + (0 if placement.is_replicate() else c + 1)
            g = torch.Generator().manual_seed(7919 * sync + 31 * i + where)
            mask = torch.rand(local.shape, generator=g) < 0.05
            local.add_(mask * torch.randn(local.shape, generator=g))


def bf16_oracle(model: torch.nn.Module, keep_tp: bool) -> dict[str, torch.Tensor]:
    """``full_tensor()`` in bf16, or under a kept TP axis each rank's TP part."""
    return full_state(model, torch.bfloat16, keep_tp=keep_tp)
