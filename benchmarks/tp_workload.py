"""The FSDP x TP benchmark workload: the demo's GPT, its TP plan on "tp", fully_shard on "dp".

The demo's GPT has separate query/key/value projections, so tensor parallelism gives each rank
whole heads (the shared GPT of shardkit.tools fuses them). About 8M parameters by default.
"""

from __future__ import annotations

from typing import Any

import torch
from demo.train_gpt import GPT, ModelConfig, tensor_parallel_plan
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

CONFIG = ModelConfig(vocab_size=4096, seq_len=128, d_model=256, n_layers=8, n_heads=4)
BATCH = 4  # sequences per data-parallel rank


def build(impl: str, mesh_shape: tuple[int, int]) -> tuple[Any, torch.optim.Optimizer, int]:
    """The model for ``impl`` ("shardkit", "torch", or "tp_only": TP without FSDP), its AdamW,
    and this rank's data-parallel index."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(CONFIG)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    if impl != "tp_only":
        import torch.distributed.fsdp as torch_fsdp

        import shardkit.core as shardkit_core

        fully_shard: Any = (shardkit_core if impl == "shardkit" else torch_fsdp).fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, opt, mesh["dp"].get_local_rank()


def batch(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch of ``step`` (B, T + 1) token ids."""
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH * dp_size, CONFIG.seq_len + 1), generator=gen)
    return idx[dp_rank * BATCH : (dp_rank + 1) * BATCH]


def dp_local_params(model: Any) -> int:
    """Elements of every parameter's TP-local tensor: what the dp axis gathers and reduces."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel()
    return total
