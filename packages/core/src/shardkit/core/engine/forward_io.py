"""What crosses a sharded module's forward: inputs moved and cast, outputs cast.

The root moves its forward's tensors to the mesh's device (as torch's FSDP does, so a
CPU-built batch works on a GPU model); ``MixedPrecisionPolicy`` casts the floating-point
inputs to ``param_dtype`` and the outputs to ``output_dtype``. Integer tensors (token ids,
masks) pass unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["cast_floats", "move_to"]


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with each floating-point tensor cast to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, cast, tree)


def move_to(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward's arguments with each tensor on ``device`` (copies issued without waiting)."""
    moved: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(device, non_blocking=True), (args, kwargs)
    )
    return moved
