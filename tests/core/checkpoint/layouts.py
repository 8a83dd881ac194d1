"""Save layouts of a large model made up in one process, for the planners' tests at
thousands of ranks (no tensor is allocated): an 8B Llama's parameters and AdamW moments."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import Replicate, Shard

from shardkit.core.checkpoint.local_plan.chunk_writers import ValueLayout, mesh_key

__all__ = ["llama_8b_layout"]

FLOAT = TensorProperties(dtype=torch.float32)


def llama_8b_layout(world: int, replica: int = 8) -> list[ValueLayout]:
    """An 8B Llama's parameters and AdamW moments, HSDP with ``replica`` ranks a replica."""
    mesh = np.arange(world, dtype=np.int64).reshape(world // replica, replica)
    key, placements = mesh_key(mesh), (Replicate(), Shard(0))
    dim, ffn, kv, vocab = 4096, 14336, 1024, 128256
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, dim))]
    for i in range(32):
        shapes += [(f"{i}.wq", (dim, dim)), (f"{i}.wk", (kv, dim)), (f"{i}.wv", (kv, dim))]
        shapes += [(f"{i}.wo", (dim, dim)), (f"{i}.w1", (ffn, dim)), (f"{i}.w2", (dim, ffn))]
        shapes += [(f"{i}.w3", (ffn, dim)), (f"{i}.norm_a", (dim,)), (f"{i}.norm_f", (dim,))]
    shapes += [("norm", (dim,)), ("output", (vocab, dim))]
    values = []
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        values += [
            ValueLayout(f"{kind}.{n}", "dtensor", s, FLOAT, mesh, placements, key)
            for n, s in shapes
        ]
    values.append(ValueLayout("step", "tensor", (), FLOAT))
    values.append(ValueLayout("lr", "bytes"))
    return values
