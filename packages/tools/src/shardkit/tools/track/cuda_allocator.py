"""The CUDA caching allocator's own figures (the one module of the tools that names torch.cuda)."""

from __future__ import annotations

import torch

__all__ = ["figures"]


def figures() -> dict[str, int]:
    """Peak and current allocated and reserved bytes on the current CUDA device."""
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }
