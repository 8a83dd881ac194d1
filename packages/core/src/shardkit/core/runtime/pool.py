"""Persistent communication buffers, reused across groups and steps.

Fresh multi-megabyte allocations every collective cost page faults and kernel time (torch's
FSDP2 pays about 3x the page faults of single-process training on CPU); a pool keeps the few
buffers that are in flight at once and hands them out again.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Free uint8 buffers by (bytes, device); ``get`` reuses one or allocates."""

    def __init__(self) -> None:
        self._free: defaultdict[tuple[int, torch.device], list[torch.Tensor]] = defaultdict(list)

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on ``device`` (contents undefined)."""
        free = self._free[(nbytes, device)]
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def put(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from ``get``; the caller must not use it afterwards."""
        self._free[(buffer.numel(), buffer.device)].append(buffer)

    def clear(self) -> None:
        """Drop every free buffer (their memory goes back to the allocator)."""
        self._free.clear()

    @property
    def held_bytes(self) -> int:
        """Bytes held by free buffers."""
        return sum(b.numel() for free in self._free.values() for b in free)
