"""An FSDP2 training program in the style of pytorch/examples, written against torch's names.

It knows nothing of shardkit: it imports ``fully_shard``, ``FSDPModule`` and
``MixedPrecisionPolicy`` from ``torch.distributed.fsdp``, shards a small transformer built on
the meta device block by block, checks the model as the examples' ``inspect_model`` does,
sets explicit forward and backward prefetching, and saves and loads both DCP checkpoints and
full-state-dict files through torch's ``torch.distributed.checkpoint.state_dict`` helpers.
Run as it is, it trains on torch's ``fully_shard``; under ``shardkit.core.patch_torch`` (or
``python -m shardkit.core.run``), on shardkit's.

The names are imported when :func:`train` runs, not when this module is imported: the test
workers import it once and run it both patched and unpatched.

As a script (under torchrun): ``fsdp2_example.py --steps N [--bf16] [--out losses.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 8
PER_RANK_BATCH = 2


class Block(nn.Module):
    """Pre-norm attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (B, T, D)
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, D/H)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return cast(torch.Tensor, x + self.fc2(F.gelu(self.fc1(self.norm2(x)))))


class Transformer(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and an output head."""

    def __init__(self, dim: int = 32, n_layers: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return cast(torch.Tensor, self.output(self.norm(h)))

    def reset_parameters(self) -> None:
        """Deterministic values from the parameters' names (no RNG: the same on any sharding)."""
        with torch.no_grad():
            for i, (name, p) in enumerate(sorted(self.named_parameters())):
                full = torch.linspace(-1.0, 1.0, math.prod(p.shape)).view(p.shape)
                full = torch.sin(full * (7 + i)) * (1.0 if "norm" in name else 0.2)
                if "norm" in name and name.endswith("weight"):
                    full = full.abs() + 0.5
                p.copy_(_like(p, full))


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``param`` (a DTensor's shard of it, or itself)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank holds the full value: no need to send it from rank 0.
        return distribute_tensor(
            full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
    return full.to(param.dtype)


@dataclass(kw_only=True)
class Plan:
    """One training run of the example program."""

    steps: range
    """The steps to train (their batches depend on the step number only)."""
    bf16: bool = False
    """Compute in bfloat16, reduce in float32 (the examples' ``--mixed-precision``)."""
    load_dcp: str | None = None
    """A DCP checkpoint folder to resume from (model and optimizer)."""
    save_dcp: str | None = None
    """Where to save a DCP checkpoint after the last step."""
    save_full: str | None = None
    """Where rank 0 saves full model and optimizer state dicts (``torch.save``)."""
    load_full: str | None = None
    """A file saved by ``save_full`` to start from, broadcast from rank 0."""
    checks: dict[str, Any] = field(default_factory=dict)
    """Filled in: what ``inspect_model`` saw."""


def inspect_model(model: nn.Module, checks: dict[str, Any]) -> None:
    """What the FSDP2 example asserts about the model right after sharding."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(model, Transformer), type(model)
    assert isinstance(model, FSDPModule), type(model).__mro__
    for param in model.parameters():
        assert isinstance(param, DTensor), type(param)
        assert param.placements == (Shard(0),), param.placements
        assert param.dtype == torch.float32, param.dtype
    checks["fsdp_modules"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    checks["class_module"] = type(model).__module__  # whose fully_shard made the class


def build(plan: Plan) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer, initialised or loaded as ``plan`` says."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer()
    kwargs: dict[str, Any] = {}
    if plan.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    inspect_model(model, plan.checks)
    blocks = [cast(FSDPModule, block) for block in model.layers]
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])
    if plan.load_full is not None:
        _load_full_model(model, plan.load_full)
    else:
        model.to_empty(device="cpu")
        model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if plan.load_full is not None:
        _load_full_optim(model, optim, plan.load_full)
    if plan.load_dcp is not None:
        load_dcp(model, optim, plan.load_dcp)
    return model, optim


def train(plan: Plan) -> list[float]:
    """Train ``plan.steps`` and return each step's loss over all ranks."""
    from torch.distributed.fsdp import FSDPModule

    model, optim = build(plan)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: list[float] = []
    for step in plan.steps:
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, VOCAB, (world * PER_RANK_BATCH, SEQ + 1), generator=gen)
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        cast(FSDPModule, model).unshard()  # explicit prefetch of the root, as the example
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    if plan.save_dcp is not None:
        save_dcp(model, optim, plan.save_dcp)
    if plan.save_full is not None:
        _save_full(model, optim, plan.save_full)
    return losses


def save_dcp(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Model and optimizer state through torch's helpers, into a DCP checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_sd, optim_sd = get_state_dict(model, optim)
    save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_dcp(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Load a checkpoint written by :func:`save_dcp` (by either engine) in place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save_full(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optim, options=options)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    dist.barrier()


def _load_full_model(model: nn.Module, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = torch.load(path, weights_only=True, mmap=True) if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full.get("model", {}), options=options)


def _load_full_optim(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    full = torch.load(path, weights_only=True, mmap=True) if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optim, full.get("optim", {}), options=options)


def main() -> None:
    """The program under torchrun: train, print and optionally write the losses."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plan = Plan(steps=range(args.steps), bf16=args.bf16)
    losses = train(plan)
    from torch.distributed.fsdp import fully_shard

    if args.out is not None and dist.get_rank() == 0:
        report = {"losses": losses, "engine": fully_shard.__module__, "checks": plan.checks}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
