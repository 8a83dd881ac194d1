"""Model changes applied before sharding, named by ``Run.prepare`` (module level: picklable)."""

from __future__ import annotations

from torch import nn


def freeze_first_block(model: nn.Module) -> None:
    """Frozen parameters next to trainable ones (in the same groups too)."""
    blocks = getattr(model, "blocks")
    for p in blocks[0].parameters():
        p.requires_grad_(False)
    getattr(model, "inp").bias.requires_grad_(False)
