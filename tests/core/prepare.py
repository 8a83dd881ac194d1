"""Model changes applied before sharding, named by ``Run.prepare`` (module level: picklable)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def freeze_first_block(model: Any) -> None:
    """Frozen parameters next to trainable ones (in the same groups too)."""
    blocks = model.blocks
    for p in blocks[0].parameters():
        p.requires_grad_(False)
    model.inp.bias.requires_grad_(False)


class Checkpointed(nn.Module):
    """Recomputes ``inner`` in backward (non-reentrant activation checkpointing)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def checkpoint_inside_blocks(model: Any) -> None:
    """Activation checkpointing of submodules inside each (sharded) block."""
    for block in model.blocks:
        block.mlp = Checkpointed(block.mlp)
        block.attn = Checkpointed(block.attn)


def checkpoint_whole_blocks(model: Any) -> None:
    """Activation checkpointing around each block (fully_shard then wraps the wrapper)."""
    blocks = model.blocks
    for i in range(len(blocks)):
        blocks[i] = Checkpointed(blocks[i])


def explicit_prefetch(model: Any) -> None:
    """Each block prefetches the next in forward and the previous in backward."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


def divide_by_three(model: Any) -> None:
    """Sum gradients and divide by 3 instead of the world size, on every module."""
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(3.0)


def freeze_bottom(model: Any) -> None:
    """The input projection and the first block frozen: no gradient reaches them at all."""
    for module in (model.inp, model.blocks[0]):
        for p in module.parameters():
            p.requires_grad_(False)


def freeze_middle_block(model: Any) -> None:
    """A whole group frozen that gradients still flow through (to the blocks below)."""
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)


class LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA, QLoRA's shape)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autograd runs the adapter's nodes (made last) before the frozen base's: the group's
        # last gradient comes in before backward is done with the frozen weight.
        out: torch.Tensor = self.base(x) + self.up(self.down(x))
        return out


def lora_above_first_block(model: Any) -> None:
    """Frozen base weights and trainable adapters in the same groups, gradients flowing
    through them to the blocks below."""
    for block in list(model.blocks)[1:]:
        block.norm.requires_grad_(False)  # else its gradient, the block's last, comes after
        block.fc1 = LoRA(block.fc1)
        block.fc2 = LoRA(block.fc2)


def late_host_copies(model: Any) -> None:
    """Offloaded gradients that land only when the engine waits (see tests/core/host_copies)."""
    from tests.core.host_copies import late_host_copies as install

    install(model)
