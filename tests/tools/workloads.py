"""Training workloads for the tools tests: one model, wrapped by each data-parallel engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.core import models

ENGINES = ("shardkit", "torch", "fsdp1", "ddp")


def build(
    engine: str,
    world_size: int,
    model_name: str = "mlp",
    hsdp: tuple[int, int] | None = None,
    *,
    freeze: Callable[[nn.Module], None] | None = None,
    param_dtype: torch.dtype | None = None,
) -> tuple[Any, torch.optim.Optimizer]:
    """The test model wrapped by ``engine`` (blocks and root sharded) and AdamW.

    With ``hsdp`` = (replicas, shard), fully_shard on a ("dp_replicate", "dp_shard") mesh.
    ``freeze`` sets ``requires_grad`` before sharding; ``param_dtype`` is the mixed-precision
    gather dtype (shardkit and torch's ``fully_shard`` only).
    """
    model = models.build(model_name)
    if freeze is not None:
        freeze(model)
    if engine == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        block_type = type(model.blocks[0])
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({block_type}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    elif engine in ("shardkit", "torch"):
        import torch.distributed.fsdp as torch_fsdp

        import shardkit.core as shardkit_core

        api: Any = shardkit_core if engine == "shardkit" else torch_fsdp
        if hsdp is None:
            mesh = init_device_mesh("cpu", (world_size,))
        else:
            mesh = init_device_mesh("cpu", hsdp, mesh_dim_names=("dp_replicate", "dp_shard"))
        mp = api.MixedPrecisionPolicy(param_dtype=param_dtype)
        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
    elif engine != "local":
        raise ValueError(f"unknown engine {engine!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(
    model: Any, opt: torch.optim.Optimizer, step: int, rank: int, world_size: int, name: str = "mlp"
) -> float:
    """One step on this rank's rows of the global batch of ``step``."""
    x, y = models.batch(name, step, 2 * world_size)
    rows = slice(2 * rank, 2 * rank + 2)
    opt.zero_grad()
    loss = models.loss_of(name, model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    return float(loss.item())


def param_count(model_name: str = "mlp") -> int:
    return sum(p.numel() for p in models.build(model_name).parameters())
