"""The FSDP1 script's training step (demo/train_fsdp1.py), at a benchmark's size.

Shared by ``bench_legacy.py`` (step time, in the pool) and ``legacy_memory_run.py`` (peak RSS,
one torchrun launch per implementation).
"""

from __future__ import annotations

import time

import torch
from demo.train_fsdp1 import Config, build, train_step
from demo.train_gpt import ModelConfig
from torch import nn

MODEL = ModelConfig(vocab_size=256, seq_len=128, d_model=256, n_layers=8, n_heads=8)
"""About 6.4M parameters: 8 transformer blocks, each its own FSDP unit."""
BATCH = 8
"""Sequences per rank per step."""


def setup(impl: str, rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The script's model and optimizer for ``impl`` ("shardkit" or "torch")."""
    return build(Config(fsdp=impl, batch_size=BATCH, model=MODEL), rank)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets at ``step`` (random tokens: speed, not learning)."""
    gen = torch.Generator().manual_seed(step)
    idx = torch.randint(0, MODEL.vocab_size, (BATCH * world_size, MODEL.seq_len + 1), generator=gen)
    mine = idx[rank * BATCH : (rank + 1) * BATCH]
    return mine[:, :-1], mine[:, 1:]


def timed_step(
    model: nn.Module, opt: torch.optim.Optimizer, data: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """Seconds of one training step of the script (forward, backward, clipping, update)."""
    start = time.perf_counter()
    train_step(model, opt, data).item()
    return time.perf_counter() - start
