"""``MixedPrecision.buffer_dtype``: buffers trained in low precision, saved in their own dtype.

FSDP1 casts every unit's buffers to its ``buffer_dtype`` when the root first runs, and state
dicts give them back in the dtype they had. The core knows no buffer dtype, so the wrapper
casts them here and remembers the originals.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["cast_buffers", "original_dtype"]

# The dtype each cast buffer had, by module and buffer name. Weak: a dropped model takes its
# entries with it.
_ORIGINAL: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.dtype]]
_ORIGINAL = weakref.WeakKeyDictionary()


def cast_buffers(modules: Iterable[nn.Module], dtype: torch.dtype) -> None:
    """Cast the floating-point buffers of ``modules`` (not their children) to ``dtype``."""
    for module in modules:
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and buffer.dtype != dtype:
                _ORIGINAL.setdefault(module, {}).setdefault(name, buffer.dtype)
                setattr(module, name, buffer.to(dtype))


def original_dtype(module: nn.Module, name: str) -> torch.dtype | None:
    """The dtype buffer ``name`` of ``module`` had before mixed precision cast it (or None)."""
    return _ORIGINAL.get(module, {}).get(name)
