"""The benchmark model and workload: a GPT-style decoder (about 8.45M parameters by default)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from tests.core.models import GPTBlock
from torch import nn


@dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    vocab: int
    dim: int
    depth: int
    heads: int
    seq: int
    batch: int  # per rank


SIZES = {
    "small": Size(vocab=4096, dim=256, depth=8, heads=4, seq=128, batch=4),
    "medium": Size(vocab=8192, dim=512, depth=8, heads=8, seq=128, batch=2),
}


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Embedding(size.seq, size.dim)
        self.blocks = nn.ModuleList(GPTBlock(size.dim, size.heads) for _ in range(size.depth))
        self.ln_f = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, size.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.ln_f(h)))


def build(impl: str, size_name: str, world_size: int) -> tuple[Any, torch.optim.Optimizer]:
    """The model wrapped by ``impl`` ('shardkit', 'torch', 'ddp' or 'local'), and AdamW."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model: Any = GPT(SIZES[size_name])
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif impl in ("shardkit", "torch"):
        import torch.distributed.fsdp as torch_fsdp

        import shardkit.core as shardkit_core

        shard: Any = (shardkit_core if impl == "shardkit" else torch_fsdp).fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            shard(block, mesh=mesh, reshard_after_forward=True)
        shard(model, mesh=mesh, reshard_after_forward=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def batch(size_name: str, step: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of the global batch of ``step``."""
    size = SIZES[size_name]
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, size.vocab, (size.batch * world_size, size.seq + 1), generator=gen)
    return idx[rank * size.batch : (rank + 1) * size.batch]


def wire_bytes() -> int:
    """Bytes this process has written (gloo's socket writes dominate during a step)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


def train_step(model: Any, opt: torch.optim.Optimizer, idx: torch.Tensor) -> dict[str, float]:
    """One timed step: zero_grad, forward, loss, backward, optimizer step, loss.item()."""
    start_bytes = wire_bytes()
    start = time.perf_counter()
    opt.zero_grad()
    out = model(idx[:, :-1])
    loss = F.cross_entropy(out.reshape(-1, out.size(-1)), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    value = loss.item()
    return {
        "seconds": time.perf_counter() - start,
        "wire_bytes": float(wire_bytes() - start_bytes),
        "loss": value,
    }


def param_count(size_name: str) -> int:
    return sum(p.numel() for p in GPT(SIZES[size_name]).parameters())


def largest_group_params(size_name: str) -> int:
    """Parameters of the largest fully_shard group (the root: embeddings, final norm, head)."""
    model = GPT(SIZES[size_name])
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block * len(model.blocks)
    return max(block, root)
