"""Small models for the tensor-parallel tests, and the TP plans torchtitan would give them."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

SEQ = 4  # divisible by the TP degree: sequence parallelism shards it
DIM = 6  # LayerNorm and residual width
HIDDEN = 12  # fc1's rows: 6 per rank at TP 2; at TP 4, 3 cut 2 + 1 across dp (uneven)


class UnevenMLP(nn.Module):
    """Linear 4 -> 6 -> 8 -> 10: every TP and dp cut of it is uneven somewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 8)
        self.c = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.c(F.relu(self.b(F.relu(self.a(x))))))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ffn = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, x + self.ffn(self.norm(x)))


class SPNet(nn.Module):
    """Input projection, pre-norm residual blocks, final norm, a 3-row head (B, SEQ, ...)."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(7, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return cast(torch.Tensor, self.head(self.norm(h)))


def build(name: str, seed: int = 0) -> Any:
    """A fresh model with the same weights on every rank."""
    torch.manual_seed(seed)
    if name == "mlp":
        return UnevenMLP()
    if name in ("sp", "sp_loss_parallel"):
        return SPNet()
    raise ValueError(f"unknown TP test model {name!r}")


def plan(name: str, model: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan: colwise/rowwise pairs; for "sp", sequence parallelism on the norms."""
    if name == "mlp":
        return {
            "a": ColwiseParallel(),
            "b": RowwiseParallel(),
            "c": ColwiseParallel(output_layouts=Replicate()),
        }
    # With loss parallelism the head's logits stay split by class (a DTensor) and the loss is
    # computed on the shards, under torch's loss_parallel() context.
    split = name == "sp_loss_parallel"
    styles: dict[str, ParallelStyle] = {
        "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if split else Replicate(),
            use_local_output=not split,
        ),
    }
    for i in range(len(cast(nn.ModuleList, model.blocks))):
        styles[f"blocks.{i}.norm"] = SequenceParallel()
        styles[f"blocks.{i}.ffn"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        styles[f"blocks.{i}.ffn.fc1"] = ColwiseParallel()
        styles[f"blocks.{i}.ffn.fc2"] = RowwiseParallel(output_layouts=Shard(1))
    return styles


def parallelize(name: str, model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Apply the model's TP plan on ``tp_mesh``."""
    parallelize_module(model, tp_mesh, plan(name, model))


def batch(name: str, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``, the same on every rank."""
    gen = torch.Generator().manual_seed(2000 + step)
    if name == "mlp":
        return torch.randn(global_batch, 4, generator=gen), torch.randn(
            global_batch, 10, generator=gen
        )
    x = torch.randn(global_batch, SEQ, 7, generator=gen)
    if name == "sp_loss_parallel":
        return x, torch.randint(0, 3, (global_batch, SEQ), generator=gen)  # classes
    return x, torch.randn(global_batch, SEQ, 3, generator=gen)


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss: cross-entropy over 3 classes for the loss-parallel model, else MSE."""
    if name == "sp_loss_parallel":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out.float(), target)
